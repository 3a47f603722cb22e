"""When the frame changes (perpetuity_core.frame.plan): append-only within a task and across prompts,
addenda before new prompts, a rebuild when the arithmetic says so, and never a stale plan."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from perpetuity_core.cli.eval import chat_request, noted
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import plan
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame.cap import Cap
from perpetuity_core.frame.select import RECENT_TOKENS
from perpetuity_core.memory.derived import bm25
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve import layout
from perpetuity_core.serve.exchange import Decision
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Message, Protocol, Provider, Reply, Usage, text_part
from perpetuity_core.wire.protocols import anthropic
from tests.test_fixtures import to_request
from tests.test_frame import say

UPSTREAMS = {Provider.ANTHROPIC: "https://a.test", Provider.OPENAI: "https://o.test"}
T0 = 1_800_000_000.0


def test_rebuild_arithmetic() -> None:
    p = plan.Plan(frame=(), frame_tokens=1_000, anchor=(0, "a"), prompt=(1, "b"), at=T0)
    assert not plan.should_rebuild(p, 900, T0 + 10, 1_000)  # it would not shrink the request
    assert plan.should_rebuild(p, 1_100, T0 + 301, 1_000)  # the cache expired: keeping is rewritten
    # Re-read 0.1 K a call since the frame, against writing a frame once at 1.25 F.
    assert not plan.should_rebuild(p, 5_000, T0 + 10, 1_000)  # 500 < 1,250
    worn = plan.carried(plan.carried(p, 5_000, T0 + 20, (3, "c")), 5_000, T0 + 30, (3, "c"))
    assert worn.excess == pytest.approx(1_000)
    assert plan.should_rebuild(worn, 5_000, T0 + 40, 1_000)  # 1,000 + 500 >= 1,250
    # A frame as long as a full latest stretch is rebuilt about as long: what it drops, even
    # less than the frame, is saved (here the cache expired, so keeping is written again).
    full = replace(p, frame_tokens=RECENT_TOKENS)
    assert plan.should_rebuild(full, 900, T0 + 301, RECENT_TOKENS)


def test_an_addendum_that_costs_a_new_frame_is_one() -> None:
    """A chat's addendum written at 1.25, with the frame and kept turns re-read at 0.1 on this
    call, against a new frame written at 1.25: a change of subject's addendum (about a frame's
    size) is a new frame, which also drops what later calls would re-read; a follow-up's small
    addendum is kept."""
    p = plan.Plan(frame=(), frame_tokens=4_000, anchor=(0, "a"), prompt=(1, "b"), at=T0)
    assert not plan.outweighs(p, 500, 300, 4_000)  # 625 + 430 < 5,000
    assert plan.outweighs(p, 3_700, 300, 4_000)  # 4,625 + 430 >= 5,000
    assert not plan.outweighs(p, 3_600, 0, 4_000)  # 4,500 + 400 < 5,000
    assert plan.outweighs(p, 2_000, 25_000, 4_000)  # 2,500 + 2,900: the kept turns re-read


def test_a_plan_holds_only_while_its_messages_are_where_they_were() -> None:
    said = [Message("user", (text_part(t),)) for t in ("one", "two", "three")]
    p = plan.Plan(frame=(), frame_tokens=0, anchor=plan.mark(said, 1), prompt=plan.mark(said, 2),
                  at=T0, inserts=((plan.mark(said, 2), (said[0],)),))
    assert plan.place(p, said) == plan.Placement(keep=1, inserts={2: (said[0],)})
    assert plan.place(p, said + [said[0]]) is not None  # the harness appended
    edited = [said[0], Message("user", (text_part("two, rewritten"),)), said[2]]
    assert plan.place(p, edited) is None  # a compaction or an edit: a new frame
    assert plan.place(p, said[:2]) is None


def _said(role: str, tokens: int, word: str) -> Message:
    return Message(role, (text_part((word + " ") * (tokens * 4 // (len(word) + 1))),))


# A conversation of 1,600 tokens before its latest prompt (message 4), and a tool round after it.
TALK = [_said("user", 400, "alpha"), _said("assistant", 400, "bravo"),
        _said("user", 400, "charlie"), _said("assistant", 400, "delta"),
        _said("user", 10, "echo"), _said("assistant", 10, "foxtrot"),
        Message("user", (text_part("golf"),))]
LIMITS = Cap(floor=100, ceiling=1_000)


def _plan(anchor: int = 2, prompt: int = 2, frame_tokens: int = 500, excess: float = 0.0,
          talk: list[Message] = TALK, pace: plan.Pace | None = None,
          agent: bool = False) -> plan.Plan:
    return plan.Plan(frame=(), frame_tokens=frame_tokens, anchor=plan.mark(talk, anchor),
                     prompt=plan.mark(talk, prompt), at=T0, excess=excess,
                     pace=pace or plan.Pace(), agent=agent)


EDITED = [TALK[0], _said("assistant", 400, "rewritten"), *TALK[2:]]


@pytest.mark.parametrize(("case", "old", "talk", "prompt", "at", "expected"), [
    ("no plan yet (a first call, a restart)", None, TALK[:5], 4, T0 + 10, plan.Rebuild),
    ("the anchor moved (a compaction, an edit)", _plan(anchor=1), EDITED[:5], 4, T0 + 10,
     plan.Rebuild),
    ("a tool round of the task in progress", _plan(prompt=4), TALK, 4, T0 + 10, plan.Carry),
    ("a tool round, even with the cache expired", _plan(prompt=4), TALK, 4, T0 + 900,
     plan.Carry),
    ("a new prompt in a short conversation", _plan(anchor=0, prompt=0), TALK[:3], 2, T0 + 10,
     plan.Rebuild),
    ("a new prompt: 0.1 x 800 re-read < 1.25 x 500 written", _plan(), TALK[:5], 4, T0 + 10,
     plan.Addendum),
    ("a new prompt after the cache expired", _plan(), TALK[:5], 4, T0 + plan.TTL + 1,
     plan.Rebuild),
    ("expired, but an agent's rebuild would not shrink the request",
     _plan(anchor=3, prompt=3, agent=True), TALK[:5], 4, T0 + plan.TTL + 1, plan.Addendum),
    # A chat's rebuilt frame is sized to the room its request has: it never grows past it.
    ("expired: a chat's frame, rebuilt, is no larger", _plan(anchor=3, prompt=3), TALK[:5], 4,
     T0 + plan.TTL + 1, plan.Rebuild),
    ("the re-reads paid reach a frame's write", _plan(excess=560), TALK[:5], 4, T0 + 10,
     plan.Rebuild),
    ("a frame under the floor is priced at the floor", _plan(frame_tokens=10),
     TALK[:5], 4, T0 + 10, plan.Addendum),
    # Tasks of 20 calls: 0.1 x 800 re-read on each of the next task's 21 / 2 calls >= 625.
    ("a long task ahead re-reads what is kept on every call", _plan(pace=plan.Pace(20, 1)),
     TALK[:5], 4, T0 + 10, plan.Rebuild),
    ("a new prompt in an agent's short conversation", _plan(anchor=0, prompt=0, agent=True),
     TALK[:3], 2, T0 + 10, plan.Addendum),
])
def test_decide(case: str, old: plan.Plan | None, talk: list[Message], prompt: int, at: float,
                expected: type) -> None:
    """What a request does with its conversation's plan, decided without a database."""
    got = plan.decide(old, talk, prompt, at, LIMITS)
    assert type(got) is expected, case
    if isinstance(got, plan.Carry | plan.Addendum):
        assert old is not None
        kept = messages_tokens(talk[old.anchor[0]:prompt])
        if messages_tokens(talk[:prompt]) <= LIMITS.ceiling:
            kept = 0  # a short conversation's rebuild would drop nothing
        # Carried: the call is priced (what a rebuild would drop, re-read once more) and the
        # plan moves to this prompt and time; nothing else of it changes.
        here = plan.mark(talk, prompt)
        assert got.plan == replace(old, at=at, prompt=here, excess=old.excess + plan.READ * kept,
                                   pace=old.pace.then(here != old.prompt)), case
    if isinstance(got, plan.Addendum):
        assert got.keep == old.anchor[0], case  # the addendum goes after what is kept


def test_an_agents_short_conversation_is_not_rebuilt_to_keep_it_all() -> None:
    """A rebuild of a conversation shorter than a frame keeps all of it, written again after a
    new frame: however long its tasks, no re-read is saved while the cache holds."""
    limits = Cap(floor=100, ceiling=2_000)  # TALK's 1,600 tokens before its prompt are short
    agent = _plan(anchor=0, prompt=0, pace=plan.Pace(20, 1), agent=True)
    assert isinstance(plan.decide(agent, TALK[:5], 4, T0 + 10, limits), plan.Addendum)
    expired = plan.decide(agent, TALK[:5], 4, T0 + plan.TTL + 1, limits)
    assert isinstance(expired, plan.Rebuild)  # everything is written again anyway


def test_decide_prices_a_plan_by_what_it_carries() -> None:
    """Addenda count as kept: what a rebuild would drop includes them."""
    light = _plan()
    heavy = replace(light, insert_tokens=6_000)  # 0.1 x 6,800 re-read >= 1.25 x 500 written
    assert isinstance(plan.decide(light, TALK[:5], 4, T0 + 10, LIMITS), plan.Addendum)
    assert isinstance(plan.decide(heavy, TALK[:5], 4, T0 + 10, LIMITS), plan.Rebuild)


class Session:
    """A coding session through a real pipeline: prompts, tool rounds, replies stored."""

    def __init__(self, tmp_path: Path, limits: Cap = Cap(),
                 tools: list[dict[str, Any]] | None = None, memory: Path | str | None = None) -> None:
        self.tools = tools or []  # the harness's own: an agent sends some, a chat none
        self.memory = memory or tmp_path / "m.db"  # a SQLite file, or a PostgreSQL URL
        self.store = open_memory(self.memory)
        # Memory of an earlier session, long enough that this one's frame has rows to show.
        say(self.store, "earlier", *[f"The {w} module parses {w} files and its tests live in"
                                     f" tests/test_{w}.py. " + "detail " * 60
                                     for w in ("toml", "yaml", "json", "csv", "ini", "xml")],
            user="dev")
        self.pipeline = Pipeline(self.store, Settings(upstreams=UPSTREAMS, limits=limits,
                                                          trust_identity=True))
        self.history: list[dict[str, Any]] = []
        self.at = T0
        self.calls = 0
        self.replies: list[str] = []  # the next replies' texts, when given

    def send(self, gap: float = 10.0) -> tuple[list[dict[str, Any]], Decision]:
        """(the messages that went upstream, the decision); `asked` keeps what the harness sent."""
        self.at += gap
        self.asked = list(self.history)
        body = {"model": "m", "max_tokens": 100, "messages": self.asked,
                **({"tools": self.tools} if self.tools else {})}
        d = self.pipeline.prepare(to_request({
            "method": "POST", "path": "/v1/messages",
            "headers": [["x-api-key", "k"], ["x-perpetuity-user", "dev"],
                        ["x-perpetuity-conversation", "now"],
                        ["x-perpetuity-time", datetime.fromtimestamp(self.at, UTC).isoformat()]],
            "body": body}))
        assert d.job is not None
        turn = self.pipeline.store_turn(d.job.pending)
        reply = self._reply()
        self.pipeline.store_reply(turn, Reply(reply, Usage()), self.at)
        self.history.append(_wire(reply))
        return (json.loads(d.body)["messages"] if d.body else list(body["messages"])), d

    def _reply(self) -> Message:
        self.calls += 1
        if self.replies:
            return Message("assistant", (text_part(self.replies.pop(0)),))
        return Message("assistant", (text_part(f"Reading the file for step {self.calls}. "
                                               + "words " * 200),))

    def prompt(self, text: str, gap: float = 10.0) -> tuple[list[dict[str, Any]], Decision]:
        self.history.append({"role": "user", "content": [{"type": "text", "text": text}]})
        return self.send(gap)

    def tool_round(self, output: str, reminder: str = "") -> tuple[list[dict[str, Any]], Decision]:
        """One more round of the task: a Read call and its `output`, with Claude Code's
        `reminder` after it when given."""
        n = self.calls
        self.history[-1] = {"role": "assistant", "content": [
            *self.history[-1]["content"],
            {"type": "tool_use", "id": f"t{n}", "name": "Read", "input": {"path": f"f{n}.py"}}]}
        self.history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{n}", "content": output},
            *([{"type": "text", "text": reminder}] if reminder else [])]})
        return self.send()


def _wire(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": [{"type": "text", "text": p.text} for p in m.parts]}


def _unmarked(messages: list[dict[str, Any]]) -> str:
    return json.dumps(messages).replace(', "cache_control": {"type": "ephemeral"}', "")


def test_within_a_task_the_request_only_grows_and_no_frame_is_built(tmp_path: Path) -> None:
    s = Session(tmp_path, Cap(floor=100, ceiling=300))
    s.prompt("Which module parses toml files?")
    for k in range(3):
        s.tool_round(f"line {k} " * 300)
    first, d = s.prompt("Now add a test for the toml module")
    assert d.frame is not None and first[0]["content"][0]["text"].startswith(frame.HEADER)
    previous = first
    for k in range(4):
        sent, d = s.tool_round(f"output {k} " * 100)
        assert d.frame is None  # nothing built: the plan is reused as it was
        # Byte for byte, the previous request (its cache marks aside) starts this one.
        assert _unmarked(sent).startswith(_unmarked(previous)[:-1])
        live = s.asked[-(2 * k + 3):]  # from the prompt on
        assert live[0]["content"][0]["text"] == "Now add a test for the toml module"
        assert sent[-len(live):] == live  # the live task exactly as the harness sent it
        previous = sent


def _then_other_work(s: Session) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Decision]:
    """Two prompts about toml, each with a tool round, then one about other work: the request
    of the second prompt, that of the third, and the third's decision."""
    s.prompt("Which module parses toml files?")
    s.tool_round("toml " * 100)
    before, _ = s.prompt("Add a test for the toml module")
    s.tool_round("ok " * 50)
    after, d = s.prompt("And where do the csv tests live?")
    return before, after, d


def test_a_new_prompt_about_other_work_gets_an_addendum_before_it(tmp_path: Path) -> None:
    s = Session(tmp_path, Cap(floor=500, ceiling=1_000))
    say(s.store, "ops", "The deploy scripts live in ops/deploy.sh.", "Thanks.", user="dev")
    # Words alone (the feedback would bring the deploy turn into the first frames). The long
    # replies outgrow a frame; the latest exchange is short, so a new frame would be large.
    s.pipeline.scanner.params = bm25.Params(feedback=0.0)
    s.replies = ["Reading. " + "words " * 400] * 3 + ["Done."] * 2
    s.prompt("Which module parses toml files?")
    s.tool_round("toml " * 100)
    before, _ = s.prompt("Add a test for the toml module")
    s.tool_round("ok " * 50)
    after, d = s.prompt("And where do the deploy scripts live?")
    assert _unmarked(after).startswith(_unmarked(before)[:-1])  # still append-only
    assert after[-1] == s.asked[-1]  # the prompt itself, as sent
    grown = json.dumps(after[len(before):-1])
    assert frame.MORE_HEADER in grown and "ops/deploy.sh" in grown
    assert d.frame is not None and after[-2]["role"] == "assistant"


def test_a_change_of_subject_whose_addendum_costs_a_frame_gets_a_new_frame(
        tmp_path: Path) -> None:
    """Frames of 300 tokens at most: the csv prompt's addendum (its top hit and the other half
    of its exchange) would be written at a frame's size, with the kept turns re-read besides;
    a new frame costs no more and drops them (plan.outweighs)."""
    s = Session(tmp_path, Cap(floor=100, ceiling=300))
    s.pipeline.scanner.params = bm25.Params(feedback=0.0)
    before, after, d = _then_other_work(s)
    assert d.recall is not None and d.recall.made == "frame"
    assert after[0]["content"][0]["text"].startswith(frame.HEADER)
    assert "tests/test_csv.py" in str(d.recall.front) and frame.MORE_HEADER not in json.dumps(after)
    assert len(json.dumps(after)) < len(json.dumps(before))  # the toml rounds went to memory


def test_an_agents_new_prompt_gets_no_addendum(tmp_path: Path) -> None:
    s = Session(tmp_path, Cap(floor=100, ceiling=300), tools=[
        {"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}])
    before, after, d = _then_other_work(s)
    assert _unmarked(after).startswith(_unmarked(before)[:-1])  # still append-only
    assert frame.MORE_HEADER not in json.dumps(after) and d.frame is None
    assert after[len(before) - 1:] == s.asked[len(s.asked) - len(after) + len(before) - 1:]


def test_history_is_replaced_once_re_reading_it_costs_more_than_a_new_frame(
        tmp_path: Path) -> None:
    s = Session(tmp_path, Cap(floor=100, ceiling=300))
    s.prompt("Which module parses toml files?")
    for n in range(8):
        for k in range(3):
            s.tool_round(f"round {n}.{k} " * 200)
        sent, _ = s.prompt(f"Step {n}: what parses the yaml files?")
    assert "round 0.0" not in json.dumps(sent)  # the old rounds are gone: memory holds them
    assert len(json.dumps(sent)) < len(json.dumps(s.asked)) / 2
    assert sent[0]["content"][0]["text"].startswith(frame.HEADER) and sent[-1] == s.asked[-1]


def test_after_the_cache_expired_a_new_prompt_gets_a_new_frame(tmp_path: Path) -> None:
    s = Session(tmp_path, Cap(floor=100, ceiling=300))
    s.prompt("Which module parses toml files?")
    for k in range(2):
        s.tool_round(f"round {k} " * 200)
    first, _ = s.prompt("Which module parses yaml?")
    later, d = s.prompt("Which module parses ini files?", gap=plan.TTL + 1)
    assert d.frame is not None and later[0] != first[0]
    # The history before the latest exchange is replaced: the frame's end, then that exchange
    # and the prompt as sent (plan.chat_keep).
    assert later[-3:] == s.asked[-3:] and "[End of quoted memory." in json.dumps(later[-4])


def test_a_short_conversation_is_sent_as_it_is_under_a_frame_for_each_prompt(
        tmp_path: Path) -> None:
    s = Session(tmp_path)  # frames up to 5,000 tokens: this history is far shorter
    s.prompt("Which module parses toml files?")
    second, d = s.prompt("Where do the csv tests live?")
    assert second[-3:] == s.asked  # its own turns all kept as sent
    assert d.frame is not None and "tests/test_csv.py" in json.dumps(second[:-3])
    third, d = s.tool_round("ok " * 20)
    assert d.frame is None and _unmarked(third).startswith(_unmarked(second)[:-1])


def test_a_chat_keeps_its_latest_exchange_whatever_its_length() -> None:
    """A chat's request starts at its latest exchange, however long the reply, or earlier
    while what it keeps fits CHAT_KEPT: always at a person's message, never a system one."""
    system = Message("system", (text_part("Be brief."),))
    long_reply = [_said("user", 50, "one"), _said("assistant", 50, "two"),
                  _said("user", 50, "three"), _said("assistant", 3_000, "four"),
                  _said("user", 10, "five")]
    assert plan.chat_keep([system, *long_reply], 5, 500) == 3
    short = [system] + [_said(role, 100, "six") for _ in range(3) for role in ("user", "assistant")]
    assert plan.chat_keep([*short, _said("user", 10, "seven")], 7, 500) == 3  # 400 tokens kept
    assert plan.chat_keep([_said("user", 10, "eight")], 0, 500) == 0
    assert plan.chat_keep([_said("assistant", 900, "hello"), _said("user", 10, "hi")], 1, 500) == 0


def test_a_chats_long_previous_answer_is_sent_as_it_is(tmp_path: Path) -> None:
    """A follow-up leans on the answer before it: when a chat's history is replaced (here at
    the first call after a restart), its latest exchange stays as sent, however long the
    answer; the turns before it are memory's."""
    limits = Cap(floor=100, ceiling=1_000)
    s = Session(tmp_path, limits)
    s.replies = ["Fine.", "Here is the plan, step by step: " + "lorem ipsum dolor " * 400]
    s.prompt("Hello there, a chat about the weekend.")
    s.prompt("Write me a long plan for the weekend.")
    answer = s.history[-1]
    s.pipeline = Pipeline(s.store, Settings(upstreams=UPSTREAMS, limits=limits,
                                            trust_identity=True))  # a restart: no plan kept
    sent, d = s.prompt("Which module parses toml files, as that plan needs?")
    assert d.frame is not None and sent[0]["content"][0]["text"].startswith(frame.HEADER)
    assert sent[-3:] == s.asked[-3:] and sent[-2] == answer  # the previous answer, whole
    assert s.asked[0] not in sent  # the first exchange is memory's, not sent as it was


def _chat_after(tmp_path: Path, exchanges: int) -> tuple[int, int]:
    """A chat client's broad question after `exchanges` short ones of the same size, each
    answered, as `perpetuity eval --sequence` asks them: its frame's budget and the messages
    that went upstream."""
    store = open_memory(tmp_path / "m.db")
    say(store, "earlier", *[f"The {w} module parses {w} files and its tests live in"
                            f" tests/test_{w}.py. " + "detail " * 60
                            for w in ("toml", "yaml", "json", "csv", "ini", "xml")], user="u")
    pipeline = Pipeline(store, Settings(upstreams=UPSTREAMS, trust_identity=True))
    history: list[dict[str, str]] = []
    for k in range(exchanges):
        history.append({"role": "user", "content": f"Remind me of day {k:03d}."})
        d = pipeline.prepare(chat_request("u", "chat", T0 + 60 * k, history))
        assert d.job is not None
        turn = pipeline.store_turn(d.job.pending)
        pipeline.store_reply(turn, Reply(noted(), Usage()), T0 + 60 * k, d.job.pending)
        history.append({"role": "assistant", "content": "Noted."})
    history.append({"role": "user",
                    "content": "Which module parses which files, and where do their tests live?"})
    d = pipeline.prepare(chat_request("u", "chat", T0 + 60 * exchanges, history))
    store.close()
    assert d.frame is not None and d.body is not None
    return d.frame.budget, len(json.loads(d.body)["messages"])


def test_a_chats_frame_does_not_shrink_as_the_chat_grows(tmp_path: Path) -> None:
    """The frame's budget is the room the request has: what a chat keeps as sent stays within
    its latest exchanges (plan.CHAT_KEPT), so a longer chat's request is no longer and its
    frame no smaller (they were: its whole history was kept while shorter than a frame)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shorter, longer = _chat_after(tmp_path / "a", 80), _chat_after(tmp_path / "b", 160)
    assert shorter[0] > Cap().floor
    assert longer == shorter


def test_a_gemini_plan_rebuilds_sooner_its_cache_writing_at_no_surcharge() -> None:
    anthropic = plan.Plan(frame=(), frame_tokens=0, anchor=(0, ""), prompt=(0, ""), at=0.0,
                          excess=105.0)
    gemini = replace(anthropic, rule=plan.rule_for(Protocol.GEMINI, "gemini-3.8-flash"))
    assert gemini.rule.write == 1.0 and gemini.rule.min_tokens == 4_096
    # 105 + 0.1 x 2,000 re-read: at least a frame of 300 written at 1.0, not at 1.25.
    assert plan.should_rebuild(gemini, 2_000, 10.0, 300)
    assert not plan.should_rebuild(anthropic, 2_000, 10.0, 300)
    assert plan.rule_for(Protocol.CHAT, "gpt-5") == plan.ANTHROPIC


def test_an_agents_frame_is_filled_within_a_narrow_questions_budget(tmp_path: Path) -> None:
    """A chat's frame takes the breadth-sized budget; an agent's only the floor's, beyond what
    must come (the top hit and its exchange): every tool round re-reads it, and its recall
    tools reach the rest."""
    limits = Cap(floor=100, ceiling=2_000)
    (tmp_path / "chat").mkdir()
    (tmp_path / "agent").mkdir()
    chat = Session(tmp_path / "chat", limits)
    agent = Session(tmp_path / "agent", limits, tools=[
        {"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}])
    broad = "Which module parses which files, and where do their tests live?"
    _, by_chat = chat.prompt(broad)
    _, by_agent = agent.prompt(broad)
    assert by_chat.frame is not None and by_agent.frame is not None
    assert len(by_chat.frame.item_ids) > 2
    assert len(by_agent.frame.item_ids) <= 2  # the top hit and the other half of its exchange


def test_kept_plans_never_hold_more_tokens_than_their_bound(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The plans kept between calls are bounded by their frames' and addenda's tokens as well
    as their number: past layout.PLAN_TOKENS the least recently used go first, a plan kept
    again counts once, and the one just kept stays whatever its size."""
    monkeypatch.setattr(layout, "PLAN_TOKENS", 1_000)
    kept = Session(tmp_path).pipeline.layout
    at = (0, "")

    def laid(tokens: int) -> plan.Plan:
        return plan.Plan(frame=(), frame_tokens=tokens, anchor=at, prompt=at, at=0.0,
                         insert_tokens=tokens // 2)

    for k in range(6):
        kept.remember((1, f"c{k}"), laid(200))  # 300 tokens each
    assert list(kept._plans) == [(1, "c3"), (1, "c4"), (1, "c5")]
    kept.remember((1, "c4"), laid(400))  # again, larger: 300 + 300 + 600 > 1,000
    assert list(kept._plans) == [(1, "c5"), (1, "c4")]
    assert kept._plan_tokens == 900
    kept.remember((1, "big"), laid(2_000))
    assert list(kept._plans) == [(1, "big")] and kept._plan_tokens == 3_000


def test_an_agents_rebuilt_frame_takes_its_top_hit_only_as_the_fill_does(tmp_path: Path) -> None:
    """An agent's frame standing in for dropped history holds the conversation's latest
    stretch, and the prompt's top hit only where the fill does; a chat's, which keeps its latest
    exchange as sent, takes the top hit whole and no stretch."""
    read = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}]
    for name, tools, agent in (("chat", None, False), ("agent", read, True)):
        (tmp_path / name).mkdir()
        s = Session(tmp_path / name, Cap(floor=100, ceiling=300), tools=tools)
        s.prompt("Which module parses toml files?")
        for k in range(3):
            s.tool_round(f"round {k} " * 200)
        _, d = s.prompt("Which module parses yaml?", gap=plan.TTL + 1)
        assert d.frame is not None
        assert (frame_select.MUST_RECENT in d.frame.must.values()) is agent, name
        assert (frame_select.MUST_TOP in d.frame.must.values()) is not agent, name


def test_the_bound_counts_the_system_messages_kept_in_front_of_the_anchor(
        tmp_path: Path) -> None:
    """A harness's system-role message stays when the history around it is replaced (Claude
    Code's list of agent types): a request's size, held to the bound, counts it."""
    read = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}]
    bound = 12_000
    s = Session(tmp_path, Cap(floor=100, ceiling=300, bound=bound), tools=read)
    s.history.append({"role": "system", "content": "agent types: " + "general-purpose " * 800})
    s.prompt("Which module parses toml files?")
    largest = 0
    for k in range(12):
        sent, _ = s.tool_round(f"line {k} " * 400)
        text = [b.get("text") or b.get("content") or "" for m in sent
                for b in ([{"text": m["content"]}] if isinstance(m["content"], str)
                          else m["content"])]
        largest = max(largest, sum(len(str(t)) + 3 for t in text) // 4)
    assert any(m["role"] == "system" for m in sent)  # it stayed, after the frame
    assert largest <= bound


def test_what_the_model_reads_counts_the_system_messages_kept_in_front_of_the_anchor(
        tmp_path: Path) -> None:
    """The token clock steps by what the model reads: a system-role message kept after the
    frame when the history around it is replaced is read on every call, so it counts."""
    read = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}]
    s = Session(tmp_path, Cap(floor=100, ceiling=300, bound=12_000), tools=read)
    s.history.append({"role": "system", "content": "agent types: " + "general-purpose " * 800})
    s.prompt("Which module parses toml files?")
    for k in range(12):
        sent, d = s.tool_round(f"line {k} " * 400)
    assert d.job is not None and any(m["role"] == "system" for m in sent)
    read_now = messages_tokens(anthropic.message_from(m) for m in sent)
    assert d.job.pending.sent_tokens == read_now
