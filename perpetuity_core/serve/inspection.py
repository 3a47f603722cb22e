"""What the model saw, and why: one flow's facts as plain JSON-able values, and their view.

On the request path the pipeline only keeps references (`Decision.parsed`, `.recall`, the
`Frame`'s ranked hits, rows and warm set; the relay's `Round`s). They are turned into facts once
the reply has gone to the client (`facts`), so that `flow.metadata` holds values mitmproxy saves
with `-w` and a saved flow file opens with; the text (`render`) is made only when a view is
opened (mitmweb, the console, `mitmdump --flow-detail`, `perpetuity show`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from perpetuity_core.frame import cap
from perpetuity_core.frame.build import Frame
from perpetuity_core.frame.plan import Plan
from perpetuity_core.frame.tenants import withheld
from perpetuity_core.memory.derived.index import messages_tokens, token_estimate
from perpetuity_core.serve.exchange import Decision, Job, Recall
from perpetuity_core.serve.relay import Round
from perpetuity_core.wire.conversation import Kind, Message

SNIPPET = 100  # characters of a row or a stripped message shown in the lists
ROWS_OUT = 20  # the best hits, and the warmest rows, left out that are listed (the rest counted)
ANSWER = 2_000  # characters of a tool's answer shown in the view (the child flow has it all)


def facts(d: Decision, job: Job | None, fell_open: str = "") -> dict[str, Any]:
    """Everything the view shows, as JSON-able values. `fell_open`: why the request went
    upstream as the client sent it after all (the addon knows: a pipeline error, a 400 retried
    as sent, the tool loop's fallback)."""
    out: dict[str, Any] = {"note": d.note, "upstream": d.route.upstream_url if d.route else ""}
    if d.route:
        out["provider"] = d.route.provider.value
        out["protocol"] = d.route.protocol.value if d.route.protocol else ""
    if d.identity:
        out |= {"tenant": d.identity.tenant, "user": d.identity.user,
                "conversation": d.identity.conversation, "harness_name": d.identity.harness,
                "side": d.identity.side}
    recall = d.recall
    why = recall.note if recall else ""
    out["fell_open"] = fell_open or (why if why.startswith("history left as sent") else "")
    out["repaired"] = why if why.startswith("kept from message") else ""
    if d.parsed is not None:
        messages = d.parsed.messages
        out["harness"] = {"messages": len(messages), "tokens": messages_tokens(messages)}
        replaced = recall is not None and recall.body is not None and not out["fell_open"]
        keep = recall.keep if replaced and recall else 0
        out["stripped"] = [_brief(i, m) for i, m in enumerate(messages[:keep])]
        out["kept"] = {"from": keep, "messages": len(messages) - keep,
                       "tokens": messages_tokens(messages[keep:])}
        out["sent_tokens"] = (recall.sent_tokens if replaced and recall
                              else out["harness"]["tokens"])
        if replaced and recall and recall.plan:  # (notes alone, before any memory: no plan)
            out |= _plan(recall, recall.plan)
        out["notes"] = list(recall.notes) if recall else []
    if d.frame is not None:
        out["retrieval"] = _retrieval(d)
    if job is not None and len(job.rounds) > 1:  # one round is the flow itself
        out["rounds"] = [_round(r) for r in job.rounds]
    return out


def _plan(recall: Recall, plan: Plan) -> dict[str, Any]:
    made = recall.made or "carried"
    frame = {"made": made, "tokens": messages_tokens(recall.front), "rows": len(plan.shown),
             "messages": [_said(m) for m in recall.front], "left_out": plan.left_out}
    addenda = [{"before": mark[0], "tokens": messages_tokens(list(added)),
                "messages": [_said(m) for m in added]} for mark, added in plan.inserts]
    return {"frame": frame, "addenda": addenda}


def _retrieval(d: Decision) -> dict[str, Any]:
    """This request's retrieval: the rows ranked, each in or out and why; then the warmest rows
    the budget left out (the warm set is warmest first)."""
    f = d.frame
    assert f is not None
    shown = set(f.item_ids)
    scores = {h.item_id: h.score for h in f.ranked}
    left = [h.item_id for h in f.ranked if h.item_id not in shown]
    cold: list[int] = []
    if f.warm is not None:
        for i in f.warm.item_ids.tolist():
            if len(cold) == ROWS_OUT:
                break
            if i in f.rows and i not in shown and i not in scores:
                cold.append(i)
    listed = np.asarray(f.item_ids + left[:ROWS_OUT] + cold, np.int64)
    warmth: dict[int, float] = {}
    if f.warm is not None:  # the warm set holds every warm row of the user: looked up in numpy
        at = np.isin(f.warm.item_ids, listed)
        warmth = dict(zip(f.warm.item_ids[at].tolist(), f.warm.warmth[at].tolist(), strict=True))
    rows = []
    for i in f.item_ids:
        why = f.must.get(i) or ("rank order, within the budget" if f.warm is None
                                else "warmth per token, within the budget")
        rows.append(_row(f, i, True, why, scores.get(i), warmth.get(i)))
    for i in left[:ROWS_OUT]:
        rows.append(_row(f, i, False, "a hit over the budget (memory_more reaches it)",
                         scores[i], warmth.get(i)))
    for i in cold:
        rows.append(_row(f, i, False, "warm, left out by the cap", None, warmth.get(i)))
    top = [h.score for h in f.ranked[:cap.BREADTH_TOP]]
    return {"made": d.recall.made if d.recall else "frame", "budget": f.budget,
            "tokens": f.tokens, "breadth": round(cap.breadth(np.asarray(top)), 2) if top else 0.0,
            "scores": [round(s, 3) for s in top[:10]], "hits": len(f.ranked),
            "left_out_warm": f.left_out, "hits_left_out": len(left), "rows": rows}


def _row(f: Frame, i: int, shown: bool, why: str, score: float | None,
         warmth: float | None) -> dict[str, Any]:
    r = f.rows.get(i)
    text = "" if r is None else withheld(r) if r.secret else r.text
    return {"id": i, "in": shown, "why": why, "score": None if score is None else round(score, 3),
            "warmth": None if warmth is None else round(warmth, 3),
            "conversation": (r.conversation or str(r.conversation_id)) if r else "",
            "role": r.role if r else "", "tokens": token_estimate(text),
            "text": _snip(text)}


def _round(r: Round) -> dict[str, Any]:
    return {"status": r.status, "started": r.started, "ended": r.ended,
            "request_tokens": token_estimate(r.body.decode("utf-8", "replace")),
            "calls": [[call_id, name, _args(args)] for call_id, name, args in r.calls],
            "results": [[call_id, text] for call_id, text in r.results]}


def _args(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def summary(f: dict[str, Any]) -> str:
    """One line for flow.comment: `frame 3,412 tok from 18 rows, 142,088 stripped, ...`."""
    bits = []
    if frame := f.get("frame"):
        verb = {"frame": "frame", "addendum": "frame", "carried": "frame kept"}[frame["made"]]
        bits.append(f"{verb} {frame['tokens']:,} tok from {_n(frame['rows'], 'row')}")
        if addenda := f.get("addenda"):
            bits.append(f"{len(addenda)} addend{'a' if len(addenda) > 1 else 'um'} "
                        f"{sum(a['tokens'] for a in addenda):,} tok")
    stripped = sum(s[2] for s in f.get("stripped", []))
    if stripped:
        bits.append(f"{stripped:,} stripped")
    if rounds := f.get("rounds"):
        n = sum(1 for r in rounds if r["calls"])
        bits.append(f"{n} tool round{'s' if n != 1 else ''}")
    if notes := f.get("notes"):
        bits.append(f"{len(notes)} note{'s' if len(notes) > 1 else ''}")
    if f.get("fell_open"):
        bits.append(f"fell open: {f['fell_open']}")
    elif f.get("repaired"):
        bits.append(f"repaired: {f['repaired']}")
    if not bits:
        bits.append(f.get("note") or "pass-through")
    return "perpetuity: " + ", ".join(bits)


def render(f: dict[str, Any], upstream_body: bytes | None = None) -> str:
    """The view: the request as the harness sent it beside what went upstream, the retrieval,
    the notes, the tool rounds, tokens and cache marks."""
    out = [summary(f), ""]
    who = ", ".join(f"{k} {f[k2]}" for k, k2 in (("user", "user"), ("conversation", "conversation"),
                    ("harness", "harness_name"), ("side", "side")) if f.get(k2))
    out += _pairs([("upstream", f.get("upstream", "")), ("who", who), ("note", f.get("note", "")),
                   ("fell open", f.get("fell_open", "")), ("repaired", f.get("repaired", ""))])
    if harness := f.get("harness"):
        sent, total = f.get("sent_tokens", 0), harness["tokens"]
        share = f" ({sent / total:.0%})" if total else ""
        out += ["", "== Tokens ==",
                f"  sent upstream {sent:,} tok against {total:,} the harness sent{share}"]
        marks = cache_marks(upstream_body) if upstream_body else []
        if marks:
            out.append(f"  cache marks placed: {len(marks)}: " + "; ".join(marks))
        elif f.get("protocol") == "anthropic-messages":
            out.append("  cache marks placed: none")
        out += ["", "== The harness sent ==",
                f"  {_n(harness['messages'], 'message')}, {total:,} tok"]
        stripped = f.get("stripped", [])
        if stripped:
            out.append(f"  stripped: messages 0-{len(stripped) - 1} "
                       f"({sum(s[2] for s in stripped):,} tok), held in memory:")
            out += [f"    #{i:<4} {role:<9} {tok:>6,} tok  {text}" for i, role, tok, text in stripped]
        kept = f.get("kept", {})
        if kept:
            out.append(f"  kept as sent: messages {kept['from']}-"
                       f"{kept['from'] + kept['messages'] - 1} ({kept['tokens']:,} tok)")
    if frame := f.get("frame"):
        made = {"frame": "built for this request", "addendum": "kept; an addendum built for "
                "this prompt", "carried": "kept from an earlier request (re-sent byte-identical)"}
        out += ["", "== What went upstream ==",
                f"  frame: {frame['tokens']:,} tok, {_n(frame['rows'], 'row')}, "
                f"{made[frame['made']]}; warm rows the cap left out: {frame['left_out']}"]
        for a in f.get("addenda", []):
            out.append(f"  addendum before message {a['before']}: {a['tokens']:,} tok")
        out += ["", "== The frame as the model read it =="]
        out += [_said_text(role, text) for role, text in frame["messages"]]
        for a in f.get("addenda", []):
            out += ["", f"== Addendum before message {a['before']} =="]
            out += [_said_text(role, text) for role, text in a["messages"]]
    if r := f.get("retrieval"):
        out += ["", f"== Retrieval ({'addendum' if r['made'] == 'addendum' else 'frame'} "
                    "built for this request) ==",
                f"  budget {r['budget']:,} tok, set by the score spread: breadth "
                f"{r['breadth']} (effective good matches among the top {cap.BREADTH_TOP}); "
                f"top scores {r['scores']}",
                f"  {_n(r['hits'], 'hit')}; {_n(sum(1 for x in r['rows'] if x['in']), 'row')} in "
                f"({r['tokens']:,} tok); {r['hits_left_out']} hits left out; "
                f"{r['left_out_warm']} warm rows considered and left out by the cap",
                f"  {'':2}{'row':>7} {'score':>7} {'warmth':>7} {'tok':>5}  "
                f"{'role':<9} {'conversation':<20} why / text"]
        for x in r["rows"]:
            score = "" if x["score"] is None else f"{x['score']:.3f}"
            warmth = "" if x["warmth"] is None else f"{x['warmth']:.3f}"
            out.append(f"  {'+' if x['in'] else '-':2}{x['id']:>7} {score:>7} {warmth:>7} "
                       f"{x['tokens']:>5}  {x['role']:<9} {x['conversation'][:20]:<20} "
                       f"{x['why']}: {x['text']}")
        if r["hits_left_out"] > ROWS_OUT:
            out.append(f"  ... {r['hits_left_out'] - ROWS_OUT} more hits left out")
    if notes := f.get("notes"):
        out += ["", "== Notes recalled ==", *(f"  {n}" for n in notes)]
    for n, rnd in enumerate(f.get("rounds", []), 1):
        flow = f" (flow {rnd['flow']})" if rnd.get("flow") else ""
        out += ["", f"== Tool round {n} of {len(f['rounds'])}{flow}: upstream "
                    f"{rnd['status']}, {rnd['request_tokens']:,} tok sent =="]
        out += render_round(rnd)
    return "\n".join(out) + "\n"


def render_round(rnd: dict[str, Any]) -> list[str]:
    answers = dict(rnd["results"])
    if not rnd["calls"]:
        return ["  the model answered (no call to our tools)"]
    out = []
    for call_id, name, args in rnd["calls"]:
        out.append(f"  call {name} {args}  [{call_id}]")
        answer = answers.get(call_id, "(no answer: the client went away)")
        cut = f"\n    ... {len(answer) - ANSWER:,} more characters" if len(answer) > ANSWER else ""
        out.append("    -> " + answer[:ANSWER].replace("\n", "\n       ") + cut)
    return out


def cache_marks(body: bytes) -> list[str]:
    """Where an Anthropic request carries `cache_control` marks, by block."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    out = []
    for where, blocks in (("tools", data.get("tools")), ("system", data.get("system"))):
        if isinstance(blocks, list):
            out += [f"{where} {i}" for i, b in enumerate(blocks)
                    if isinstance(b, dict) and "cache_control" in b]
    for i, m in enumerate(data.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out += [f"message {i} block {j}" for j, b in enumerate(content)
                    if isinstance(b, dict) and "cache_control" in b]
    return out


def _n(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def _pairs(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"{k:<10} {v}" for k, v in pairs if v]


def _said(m: Message) -> list[str]:
    return [m.role, "\n".join(_part(p) for p in m.parts)]


def _part(p: Any) -> str:
    if p.kind == Kind.TOOL_CALL:
        return f"[call {p.name}: {p.text}]"
    if p.kind == Kind.TOOL_RESULT:
        return f"[result: {p.text}]"
    return p.text


def _said_text(role: str, text: str) -> str:
    return f"[{role}]\n  " + text.replace("\n", "\n  ")


def _brief(i: int, m: Message) -> list[Any]:
    text = " ".join(_part(p) for p in m.parts)
    return [i, m.role, token_estimate(text), _snip(text)]


def _snip(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SNIPPET else flat[:SNIPPET - 3] + "..."

