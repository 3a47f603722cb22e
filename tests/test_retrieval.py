"""Retrieval: the dictionary, retrieval rows in the write path, and the exact scan.

The fast scan is checked against `reference`, a slow and obvious BM25 over the rows read back
from the store, on random memories and queries: same rows, same order, same scores.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from perpetuity_core.memory.derived import arena, bm25, chains, index, scan, vectors, view
from perpetuity_core.memory.jobs import importers, maintenance
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import dictionary
from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.conftest import opened_other

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"benchmark data not present at {SHARED} (../shared/data)")

WORDS = ["support", "group", "painting", "sunrise", "camping", "kids", "dog", "cat", "guitar", "concert", "book", "library", "museum", "hiking", "beach", "adoption", "counseling", "pottery", "marathon", "recipe", "garden", "violin", "python", "deploy", "server", "database", "index", "query", "latency", "memory", "arena", "segment"]
STOP = ["the", "a", "of", "to", "and", "was", "is", "i", "you", "we"]


def add(store: Store, user: str, conv: str, texts: list[str], role: str = "user",
        at: float = 0.0) -> list[int]:
    """One message per text (a text with ' | ' in it becomes several parts)."""
    uid = store.user_id(user)
    cid = store.conversation_id(uid, conv, "anthropic")
    items = []
    for i, t in enumerate(texts):
        parts = tuple(Part(Kind.TEXT, p) for p in t.split(" | "))
        w = store.add_message(conversation_id=cid, user_id=uid, message=Message(role, parts),
                              provider="anthropic", model="m", at=at + i,
                              pair_key=f"{conv}-{at}-{i}-{random.random()}", source="import")
        items.extend(w.item_ids)
    return items


def random_text(rng: random.Random) -> str:
    n = rng.choice([1, 2, 3, 5, 8, 13, 40])
    # Zipf-ish: early words are common, so df spans from most rows to a few.
    words = [WORDS[min(int(rng.paretovariate(0.9)) - 1, len(WORDS) - 1)] if rng.random() < 0.8
             else rng.choice(STOP) for _ in range(n)]
    return " ".join(words)


def fill(store: Store, rng: random.Random, n: int = 300) -> None:
    for i in range(n):
        user = f"u{rng.randrange(3)}"
        text = random_text(rng)
        if rng.random() < 0.2:
            text += " | " + random_text(rng)
        add(store, user, f"{user}-c{rng.randrange(2)}", [text], at=float(i))


# ------------------------------------------------------------------------------ reference


def reference(store: Store, query: str, user_id: int | None, k: int, *, share: bool = False,
              conversation_id: int | None = None, exclude: frozenset[int] = frozenset(),
              params: bm25.Params = bm25.Params(),
              during: tuple[float, float] | None = None,
              again: int | None = None) -> list[tuple[int, float]]:
    """Brute-force score of every row, in plain Python: (item_id, score), best first.

    BM25 of each row, plus the weighted BM25 of the rows before and after it in its
    conversation (store order), as bm25.Params describes, the query's terms with those the
    table brings (nearest, with semantic and expand on); then the semantic half, for the
    visible rows of the conversations holding the view.SEMANTIC_FROM best visible rows by
    that score (ties by seq): each one's cosine with the query (integer dot products of the
    stored int8 vectors), at zero below zero, times semantic * the best of those scores
    (none when no row scores). The query's vector is the table's vectors of its terms, each weighed
    by its idf computed here; `during` keeps the rows said in that span, scored as without
    it. With feedback on, of the first max(k + excluded, bm25.FEEDBACK_ROWS) rows so ranked
    (before `exclude`), those of the best one's conversation (or of `again`) are replaced,
    place by place, by that conversation's rows ranked by all that again (among themselves),
    every count (rows, lengths, document frequencies: idf, the table's terms, the query's
    vector) taken over that conversation's rows alone (over every row where it holds
    scan.OWN_BELOW of them or more), with the terms its rows among the
    bm25.FEEDBACK_ROWS best bring (fed_back); each takes its place's score, and places left
    over take that conversation's rows of the first ranking not taken yet, in order.
    """
    k1, b = params.k1, params.b
    conn = opened_other(store.path)
    rows = conn.execute("SELECT seq, item_id, user_id, conversation_id, length, terms, counts"
                        " FROM retrieval ORDER BY seq").fetchall()
    vecs = {seq: list(np.frombuffer(v, np.int8).tolist()) for seq, v in conn.execute(
        "SELECT seq, vec FROM retrieval")}
    said = {i: int(at) for i, at in conn.execute(  # whole seconds, as retrieval keeps them
        "SELECT i.id, m.at FROM item i JOIN message m ON m.id = i.message_id")}
    conn.close()
    decoded = []
    for seq, item, user, conv, length, tb, cb in rows:
        terms = [int.from_bytes(tb[i:i + 4], "little", signed=True) for i in range(0, len(tb), 4)]
        decoded.append((seq, item, user, conv, length, dict(zip(terms, list(cb), strict=True))))
    if not rows:
        return []
    qtf = Counter(store.db.dictionary.ids(query).tolist())
    chains: dict[int, list[int]] = {}
    for seq, _, _, conv, _, _ in decoded:
        chains.setdefault(conv, []).append(seq)
    visible = {seq for seq, _, user, conv, _, _ in decoded
               if (user_id is None or user == user_id or share)
               and (conversation_id is None or conv == conversation_id)}
    conv_of = {seq: conv for seq, _, _, conv, _, _ in decoded}

    def statistic(among: list[tuple]) -> tuple[Counter[int], int, float, dict[int, float],
                                               list[int] | None]:
        """df, rows, mean length, the query's counts (its table's terms too) and vector, over
        the rows `among`."""
        df: Counter[int] = Counter()
        for *_, tf in among:
            df.update(tf.keys())
        n = len(among)
        counts: dict[int, float] = dict(qtf)
        if params.semantic > 0 and params.expand > 0:
            counts |= nearest(store, qtf, df, params.expand)
        q = semantic_query(store, query, df, n) if params.semantic > 0 else None
        return df, n, sum(r[4] for r in among) / max(n, 1), counts, q

    def idf_of(df: Counter[int], n: int) -> Callable[[int], float]:
        # numpy's log1p, not math's: they differ in the last bit for a few % of inputs.
        return lambda t: float(np.log1p(np.float64((n - df[t] + 0.5) / (df[t] + 0.5))))

    def scored(stats: tuple, counts: dict[int, float], among: set[int]) -> dict[int, float]:
        df, n, avgdl, _, q = stats
        idf = idf_of(df, n)
        plain = {}
        for seq, _, _, _, length, tf in decoded:
            s = 0.0
            for t in sorted(counts):
                if df[t] and t in tf:
                    w = counts[t] * idf(t) * (k1 + 1)
                    s += w * tf[t] / (tf[t] + (k1 * (1 - b) + k1 * b / avgdl * length))
            plain[seq] = s
        lexical = {}
        for seq, _, _, conv, _, _ in decoded:
            chain = chains[conv]
            i = chain.index(seq)
            s = plain[seq]
            for d, w in enumerate(params.before, 1):
                s = s + w * (plain[chain[i - d]] if i - d >= 0 else 0.0)
            for d, w in enumerate(params.after, 1):
                s = s + w * (plain[chain[i + d]] if i + d < len(chain) else 0.0)
            lexical[seq] = s
        found = sorted((-lexical[s], s) for s in among if lexical[s] > 0)
        if q is not None and found:
            scale = params.semantic * -found[0][0]
            qn = math.sqrt(sum(x * x for x in q))
            convs = {conv_of[s] for _, s in found[:view.SEMANTIC_FROM]}
            for seq in (s for s in among if conv_of[s] in convs):
                v = vecs[seq]
                sq = sum(x * x for x in v)
                cos = float(sum(x * y for x, y in zip(v, q))) * (1.0 / math.sqrt(sq)) / qn if sq else 0.0
                lexical[seq] = scale * max(cos, 0.0) + lexical[seq]
        return lexical

    def ranking(scores: dict[int, float]) -> list[tuple[bool, float, int, int]]:
        out = []
        for seq, item, user, _, _, _ in decoded:
            s = scores[seq]
            if seq not in visible:
                continue
            if during is not None and not during[0] <= said[item] < during[1]:
                continue
            if s > 0:
                out.append((not (user_id is None or user == user_id), -s, seq, item))
        return sorted(out)

    pooled = statistic(decoded)
    lexical = scored(pooled, pooled[3], visible)
    first = ranking(lexical)[:max(k + len(exclude), bm25.FEEDBACK_ROWS)]
    best = [(-negs, seq) for _, negs, seq, _ in first[:bm25.FEEDBACK_ROWS]]
    if params.feedback > 0 and (best or again is not None):  # as its own memory ranks it
        conv = conv_of[best[0][1]] if again is None else again
        best = [(score, seq) for score, seq in best if conv_of[seq] == conv]
        own = statistic([r for r in decoded if r[3] == conv])
        if own[1] >= scan.OWN_BELOW * len(decoded):
            own = pooled
        more = fed_back(best, {seq: (tf, length, c) for seq, _, _, c, length, tf in decoded},
                        own[3], params.feedback, idf_of(own[0], own[1]))
        inside = {s for s in visible if conv_of[s] == conv}
        fed = scored(own, own[3] | more, inside)
        again = ranking({s: fed[s] if s in inside else 0.0 for s in lexical})
        taken = {r[2] for r in again}
        again += [p for p in first if p[2] in inside and p[2] not in taken]
        first = [(p[0], p[1], r[2], r[3]) for p, r in zip(
            first, (again.pop(0) if p[2] in inside else p for p in first), strict=True)]
    out = [r for r in first if r[3] not in exclude]
    return [(item, -negs) for _, negs, _, item in out[:k]]


def fed_back(best: list[tuple[float, int]], bag: dict[int, tuple[dict[int, int], int, int]],
             counts: dict[int, float], weight: float, idf: Callable[[int], float]
             ) -> dict[int, float]:
    """The terms the best rows (score, seq; rank order, before any exclusion) bring
    (bm25.fed_back): of the rows of the first one's conversation of at most
    bm25.FEEDBACK_LENGTH terms, each term the query lacks weighs the sum of score * count /
    length, times its idf; the bm25.FEEDBACK_TERMS heaviest (ties by id) count weight *
    theirs / the heaviest's."""
    mass: dict[int, float] = {}
    for score, seq in best:
        tf, length, conv = bag[seq]
        if length > bm25.FEEDBACK_LENGTH or conv != bag[best[0][1]][2]:
            continue
        for t in sorted(tf):
            if t not in counts:
                mass[t] = mass.get(t, 0.0) + score * tf[t] / max(length, 1)
    heavy = sorted((-m * idf(t), t) for t, m in mass.items())[:bm25.FEEDBACK_TERMS]
    heavy = [(negw, t) for negw, t in heavy if negw < 0]
    return {t: weight * -negw / -heavy[0][0] for negw, t in heavy}


def nearest(store: Store, qtf: Counter[int], df: Counter[int],
            weight: float) -> dict[int, float]:
    """The terms the query's terms bring (bm25.expanded): for each query term, by the table's
    cosine with it (at least vectors.NEAR_MIN, best first, ties by id), the first vectors.NEAR
    other terms that some row holds and the query does not, each counted weight * cosine * the
    query term's count, the most over the query's terms."""
    d = store.db.dictionary
    table = vectors.table().terms(d)
    out: dict[int, float] = {}
    for t in sorted(qtf):
        if t >= d.hash_base:
            continue
        sims = np.einsum("ij,j->i", table, table[t]).astype(np.float64).tolist()
        near = sorted((-s, u) for u, s in enumerate(sims)
                      if s >= vectors.NEAR_MIN and u != t and df[u] and u not in qtf)
        for negs, u in near[:vectors.NEAR]:
            out[u] = max(out.get(u, 0.0), weight * -negs * qtf[t])
    return out


def semantic_query(store: Store, query: str, df: Counter[int], n: int) -> list[int] | None:
    """The query's int8 vector: the table's vectors of its terms, each weighed by its count
    times its idf (a term no row holds at the highest idf)."""
    d = store.db.dictionary
    qtf = Counter(d.ids(query).tolist())
    terms = sorted(qtf)
    weights = [qtf[t] * float(np.log1p(np.float64((n - df[t] + 0.5) / (df[t] + 0.5))))
               for t in terms]
    q = vectors.table().query(d, np.array(terms, np.int32), np.array(weights))
    return None if q is None else q.tolist()


def ranked(hits: list[scan.Hit]) -> list[tuple[int, float]]:
    return [(h.item_id, h.score) for h in hits]


def same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [i for i, _ in got] == [i for i, _ in want]
    assert [s for _, s in got] == [s for _, s in want]  # bit for bit


# ------------------------------------------------------------------------------ dictionary


def test_dictionary_folds_case_accents_and_inflections() -> None:
    d = dictionary.shipped()
    assert list(d.ids("Painting PAINTS painted")) == [d.ids("paint")[0]] * 3
    assert list(d.ids("Café naïve")) == list(d.ids("cafe naive"))  # Rust path == ASCII path
    assert d.ids("the of and").size == 0  # stop words are not indexed
    bag = d.bag("guitar " * 300 + "violin violin")
    assert (bag.counts.tolist(), bag.length) == ([255, 2], 302)  # tf capped at one byte


def test_ascii_fast_path_matches_the_tokenizers_pipeline() -> None:
    d = dictionary.shipped()
    rng = random.Random(2)
    alphabet = "abcXYZ019 _-'.,:;!?()[]{}<>/\\|@#$%^&*+=~`\"\n\t"
    texts = ["Don't STOP-believing: it's 2024's e-mail_address (x.y@z.com)!"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    for text in texts:
        # A right single quote is a separator for both, and sends the text down the Rust path.
        assert d.id_list(text) == d.id_list(text + "\u2019"), text


def test_unknown_words_hash_deterministically_into_the_reserved_range() -> None:
    d = dictionary.shipped()
    (t,) = d.ids("zorblaxification")
    assert d.hash_base <= t < d.n_terms
    assert t == dictionary.hash_term(dictionary.stem("zorblaxification"), d.hash_base)
    code = ("from perpetuity_core.memory.storage import dictionary;"
            "print(int(dictionary.shipped().ids('zorblaxification')[0]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=ROOT, check=True)
    assert int(other.stdout) == t  # stable across processes (no PYTHONHASHSEED)


def reference_subjects(d: dictionary.Dictionary, text: str) -> list[str]:
    """chains.subjects, slow and obvious: every distinct word stemmed, counted by stem, the
    most repeated first, then the rarest, ties by stem."""
    counts: Counter[str] = Counter()
    for w in (text[:chains.SUBJECT_CHARS].encode("ascii").translate(dictionary.ASCII_FOLD)
              .decode().split() if text.isascii() else d.words(text[:chains.SUBJECT_CHARS])):
        if len(w) >= 3 and not w.isdigit() and w not in dictionary.STOP_WORDS:
            s = dictionary.stem(w)
            if chains.stem_rank(d, s) >= dictionary.FIRST_STEM_ID + chains.COMMON_STEMS:
                counts[s] += 1
    return sorted(counts, key=lambda s: (-counts[s], -chains.stem_rank(d, s), s))[:chains.SUBJECTS]


def test_subjects_match_the_reference() -> None:
    d = dictionary.shipped()
    rng = random.Random(3)
    vocab = sorted(d.word_ids)
    texts = ["", "   ", "Caroline: running runs RUN ran, painted paintings", "x" * 5000,
             "Über naïve café résumé Straße Straße", "東京 東京 東京 の テキスト",
             " ".join(["guitar"] * 3 + ["violin"] * 3 + ["zorblax"] * 3 + ["1234"] * 5)] + [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 80))) for _ in range(300)]
    if SHARED.is_dir():
        texts += [p.text for t in importers.locomo(SHARED / "locomo" / "locomo10.json")
                  for m in t.messages[:60] for p in m.parts]
    for text in texts:
        assert chains.subjects(d, text) == reference_subjects(d, text), text[:80]


def test_the_bag_and_the_subjects_from_one_count_match_their_own() -> None:
    """Dictionary.packed_counted and chains.counted_subjects (one count for a text row's bag
    and its chains) give bag() and subjects() exactly, and so does packed(): short words and
    numbers the vocabulary holds are no subject but count in the bag, unseen words are stemmed
    for both, a term counted past MAX_TF is capped."""
    d = dictionary.shipped()
    rng = random.Random(4)
    vocab = sorted(w for w in d.word_ids if w.isascii())
    texts = ["", "   ", "the of and",
             "tv TVs tvs 2023 2023 d2 uk UK ok 65535 zorblax zorblaxes zorblaxing",
             "Caroline: running runs RUN ran, painted paintings the of and",
             "guitar " * 300 + "zqxv " * 260 + "42 violin"] + [
        " ".join(rng.choice(vocab + ["zqxv", "Zqxvs", "42", "id"]) for _ in range(rng.randint(1, 80)))
        for _ in range(300)]
    if SHARED.is_dir():
        texts += [p.text for t in importers.locomo(SHARED / "locomo" / "locomo10.json")
                  for m in t.messages[:200] for p in m.parts if p.text.isascii()]
    for text in texts:
        packed, known, unseen = d.packed_counted(text)
        want = d.bag(text)
        stored = (want.terms.astype("<i4").tobytes(), want.counts.tobytes(), want.length)
        assert tuple(packed) == stored, text[:80]
        assert tuple(d.packed(text)) == stored, text[:80]
        assert chains.counted_subjects(d, known, unseen) == reference_subjects(d, text), text[:80]


def test_a_long_text_is_counted_once_for_its_bag_and_its_head_subjects() -> None:
    """Dictionary.packed_counted(text, head) of a text longer than `head`: the bag of the whole
    text and the subjects of its head (what chains.subjects reads), whether a word runs
    across the cut or not, and whatever the words either side are (unseen, numbers, stop
    words, short ones)."""
    d = dictionary.shipped()
    rng = random.Random(5)
    vocab = sorted(w for w in d.word_ids if w.isascii())
    cut = chains.SUBJECT_CHARS
    texts = ["x" * (cut + 1), "x" * cut + " tail", "x" * (cut - 1) + " y" * 9,
             " " * cut + "word", "word" + " " * cut, "ab " * 2000]
    for _ in range(150):
        words = rng.choices(vocab + ["zqxv", "Zqxvs", "42", "id", "the", "12345"], k=1500)
        text = " ".join(words)
        for w in ("guitar", "zorblaxing", "4242", "id"):  # one word across the cut
            texts.append(text[:cut - 2] + " " + w + " " + text[cut:])
        texts += [text, text[:cut - 1] + " " + text[cut:], text[:cut] + " " + text[cut:]]
    assert sum(len(t) > cut for t in texts) > 600
    for text in texts:
        packed, known, unseen = d.packed_counted(text, cut)
        want = d.bag(text)
        stored = (want.terms.astype("<i4").tobytes(), want.counts.tobytes(), want.length)
        assert tuple(packed) == stored, text[cut - 40:cut + 40]
        assert chains.counted_subjects(d, known, unseen) == reference_subjects(d, text), (
            text[cut - 40:cut + 40])


def test_a_batch_takes_the_subjects_counted_when_stored_under_their_version(
        sqlite_store: Store) -> None:
    """The chains' batch uses the subjects derive_retrieval noted, and counts a text again when
    they were noted under another dictionary version."""
    kayak, canoe = add(sqlite_store, "u", "c", ["The kayak is orange.", "The canoe is green."])
    version, noted = chains._NOTED[sqlite_store.db]
    assert version == sqlite_store.db.dictionary.version and noted.keys() == {kayak, canoe}
    noted[kayak] = ["planted"]  # taken as it is: the batch does not recount
    sqlite_store.flush()
    got = {t for (t,) in sqlite_store.db.connection().execute("SELECT term FROM chain")}
    assert got == {"planted", *chains.subjects(sqlite_store.db.dictionary, "The canoe is green.")}
    assert sqlite_store.db not in chains._NOTED  # the batch took them all
    (raft,) = add(sqlite_store, "u", "c", ["The raft is blue."])
    chains._NOTED[sqlite_store.db] = ("another version", {raft: ["planted"]})
    sqlite_store.flush()
    got = {t for (t,) in sqlite_store.db.connection().execute("SELECT term FROM chain")}
    assert got - {"planted", "cano", "green"} == {"raft", "blu"}  # counted from the text


def test_every_item_gets_one_retrieval_row_with_counts_and_version(store: Store) -> None:
    fill(store, random.Random(1), 60)
    index.sequence(store.db)  # PostgreSQL: the rows are ordered in before a reader reads them
    conn = opened_other(store.path)
    (items,) = conn.execute("SELECT count(*) FROM item").fetchone()
    rows = conn.execute("SELECT item_id, version, terms, length FROM retrieval").fetchall()
    assert len(rows) == items and len({r[0] for r in rows}) == items
    assert {r[1] for r in rows} == {store.db.dictionary.version}
    df: Counter[int] = Counter()
    for r in rows:
        df.update(np.frombuffer(r[2], "<i4").tolist())
    terms = np.array(sorted(df), np.int32)
    with store.db.peewee.atomic():
        assert index.unfolded_df(store.db, store.db.connection(), terms).tolist() == [df[t] for t in terms]
        index.fold(store.db, store.db.connection())
    assert dict(conn.execute("SELECT term, df FROM retrieval_term").fetchall()) == dict(df)
    assert conn.execute("SELECT rows, length FROM retrieval_total").fetchone() == (
        len(rows), sum(r[3] for r in rows))
    conn.close()


def recount(conn: Sql) -> tuple[tuple[int, int, int], dict[int, int]]:
    """The pooled counts from scratch: (rows, length, tokens) and df of the live rows."""
    rows = conn.execute("SELECT length, tokens, terms FROM retrieval").fetchall()
    df: Counter[int] = Counter()
    for r in rows:
        df.update(np.frombuffer(r[2], "<i4").tolist())
    return (len(rows), sum(r[0] for r in rows), sum(r[1] for r in rows)), dict(df)


def pooled(store: Store, conn: Sql) -> tuple[tuple[int, int, int], dict[int, int]]:
    """The pooled counts as readers get them: folded, plus the rows stored since."""
    terms = np.array(sorted({t for (b,) in conn.execute("SELECT terms FROM retrieval")
                             for t in np.frombuffer(b, "<i4").tolist()}), np.int32)
    df = index.unfolded_df(store.db, store.db.connection(), terms).tolist() if terms.size else []
    return tuple(index.totals(conn)), dict(zip(terms.tolist(), df, strict=True))


def test_pooled_counts_stay_exact_through_folds_purges_and_deletions(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "FOLD_EVERY", 9)
    rng = random.Random(23)
    conn = store.db.translated()
    for step in range(30):
        fill(store, rng, rng.randint(1, 12))
        index.sequence(store.db)
        live = [i for (i,) in conn.execute("SELECT item_id FROM retrieval")]
        if step % 3 == 0:
            index.purge(store, rng.sample(live, 2))
        elif step % 3 == 1:
            # Deleted behind the store's back, before its row is folded; settled only later
            # (by the next fold or a reader's catch-up), after the cursor has passed it.
            with store.db.peewee.atomic():
                conn.execute("DELETE FROM item WHERE id = ?", (max(live),))
        if step % 5 == 4:
            index.settle(store)
        # Readers take unsettled deletions out themselves: exact at every step.
        assert pooled(store, conn) == recount(conn)
    index.settle(store)
    with store.db.peewee.atomic():
        index.fold(store.db, store.db.connection())
    assert pooled(store, conn) == recount(conn)
    (rows, length, tokens), df = recount(conn)
    assert conn.execute("SELECT rows, length, tokens FROM retrieval_total").fetchone() == (
        rows, length, tokens)
    assert dict(conn.execute("SELECT term, df FROM retrieval_term").fetchall()) == df


def test_totals_counted_with_every_message_are_migrated(tmp_path: Path) -> None:
    s = open_memory(tmp_path / "old.db")
    fill(s, random.Random(29), 40)
    conn = s.db.translated()
    with s.db.peewee.atomic():
        index.fold(s.db, s.db.connection())
    fill(s, random.Random(31), 25)
    with s.db.peewee.atomic():  # one unfolded row deleted and not yet settled
        conn.execute("DELETE FROM item WHERE id = (SELECT max(item_id) FROM retrieval)")
    # The database as before m006: totals counted every row with its message.
    (rows, length, tokens), _ = recount(conn)
    (g_len, g_tok) = conn.execute("SELECT length, tokens FROM retrieval_gone").fetchone()
    with s.db.peewee.atomic():
        conn.execute("UPDATE retrieval_total SET rows = ?, length = ?, tokens = ?",
                     (rows + 1, length + g_len, tokens + g_tok))
        conn.execute("DROP TABLE derived")
        conn.execute("DELETE FROM migration WHERE name = 'm006_batched'")
    s.close()
    s = open_memory(tmp_path / "old.db")
    try:
        conn = s.db.translated()
        index.settle(s)
        assert pooled(s, conn) == recount(conn)
    finally:
        s.close()


def test_rows_stored_before_m008_learn_when_they_were_said(tmp_path: Path) -> None:
    s = open_memory(tmp_path / "old.db")
    fill(s, random.Random(37), 30)
    conn = s.db.translated()
    with s.db.peewee.atomic():  # the database as before m008
        conn.execute("ALTER TABLE retrieval DROP COLUMN at")
        conn.execute("DELETE FROM migration WHERE name = 'm008_retrieval_time'")
    s.close()
    s = open_memory(tmp_path / "old.db")
    try:
        said = s.db.translated().execute(
            "SELECT r.at, m.at FROM retrieval r JOIN message m ON m.id = r.message_id").fetchall()
        assert len(said) >= 30 and all(a == int(b) for a, b in said)
        assert {a for a, _ in said} != {0.0}
    finally:
        s.close()


# ------------------------------------------------------------------------------ the scan


PLAIN = bm25.Params(before=(), after=())  # BM25 alone, no conversational context


@pytest.mark.parametrize("params", [bm25.Params(), PLAIN, bm25.Params(1.2, 0.75),
                                    bm25.Params(semantic=0.0), bm25.Params(feedback=0.0),
                                    bm25.Params(feedback=1.0)],
                         ids=["context", "plain", "k1-b", "lexical", "no-feedback", "feedback"])
@pytest.mark.parametrize("path", ["store", "terms", "rows"])
def test_scan_is_exact_against_the_reference(store: Store, path: str, params: bm25.Params,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 37)  # many segments, merges, partial tails
    rng = random.Random(7)
    fill(store, rng, 250)
    store_rows = 10**9 if path == "store" else 0
    sc = scan.Scanner(store, layout=arena.ROWS if path == "rows" else arena.TERMS,
                      store_rows=store_rows, threads=2, params=params)
    shared = scan.Scanner(store, share_pool=True, store_rows=store_rows, params=params)
    users = [store.user_id(f"u{i}") for i in range(3)]
    for _ in range(40):
        q = " ".join(rng.choice(WORDS + STOP) for _ in range(rng.randint(1, 6)))
        uid = rng.choice(users + [None])
        k = rng.choice([1, 5, 10, 50])
        same(ranked(sc.search(q, uid, k)), reference(store, q, uid, k, params=params))
        same(ranked(shared.search(q, uid, k)),
             reference(store, q, uid, k, share=True, params=params))
        cid = store.conversation_id(users[0], "u0-c1", "anthropic")
        same(ranked(sc.search(q, users[0], k, conversation_id=cid)),
             reference(store, q, users[0], k, conversation_id=cid, params=params))
        full = reference(store, q, uid, 50, params=params)
        ex = frozenset(i for i, _ in full[:3])
        same(ranked(sc.search(q, uid, k, exclude=ex)),
             reference(store, q, uid, k, exclude=ex, params=params))
        span = tuple(sorted(rng.uniform(0, 260) for _ in range(2)))
        same(ranked(shared.search(q, uid, k, during=span)),
             reference(store, q, uid, k, share=True, params=params, during=span))
        again = store.conversation_id(users[rng.randrange(3)], f"u{rng.randrange(3)}-c0",
                                      "anthropic")
        same(ranked(shared.search(q, uid, k, again=again)),
             reference(store, q, uid, k, share=True, params=params, again=again))


def test_same_ranking_whatever_the_threads_and_layout(store: Store,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 16)
    monkeypatch.setattr(view, "POOL_ROWS", 0)  # the workers score even this small memory
    rng = random.Random(3)
    fill(store, rng, 200)
    for i in range(30):  # identical rows: exact ties, broken by store order
        add(store, "u0", "u0-c0", ["support group guitar"], at=1000.0 + i)
    scanners = [scan.Scanner(store, threads=t, layout=lay, store_rows=0)
                for t in (1, 2, 3, 4) for lay in (arena.TERMS, arena.ROWS)]
    scanners.append(scan.Scanner(store, store_rows=10**9))
    uid = store.user_id("u0")
    for q in ["support group guitar", "guitar", "memory arena segment query", "dog the cat"]:
        results = [ranked(s.search(q, uid, 25)) for s in scanners]
        assert all(r == results[0] for r in results)  # scores bit for bit, ties included


@pytest.mark.parametrize("store_rows", [0, 10**9], ids=["arena", "store"])
def test_catch_up_sees_inserts_purges_and_rederived_rows(store: Store, store_rows: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 50)
    monkeypatch.setattr(index, "FOLD_EVERY", 7)  # purges hit folded and unfolded rows alike
    rng = random.Random(11)
    fill(store, rng, 120)
    sc = scan.Scanner(store, store_rows=store_rows)
    uid = store.user_id("u1")
    q = "support guitar zorblax"
    same(ranked(sc.search(q, uid, 10)), reference(store, q, uid, 10))
    new = add(store, "u1", "u1-c0", ["zorblax zorblax guitar"] * 3)
    got = ranked(sc.search(q, uid, 10))
    assert set(new) <= {i for i, _ in got}  # no query misses a committed row
    same(got, reference(store, q, uid, 10))
    gone = [i for i, _ in got[:4]]
    index.purge(store, gone)
    got = ranked(sc.search(q, uid, 10))
    assert not set(gone) & {i for i, _ in got}
    marks = ",".join("?" * len(gone))
    assert not opened_other(store.path).execute(
        f"SELECT item_id FROM activation WHERE item_id IN ({marks})", gone).fetchall()
    same(got, reference(store, q, uid, 10))
    # A row removed behind the scanner's back (cascade from item) is also reflected.
    conn = opened_other(store.path)
    victim = got[0][0]
    conn.execute("DELETE FROM item WHERE id = ?", (victim,))
    conn.commit()
    got = ranked(sc.search(q, uid, 10))
    assert victim not in {i for i, _ in got}
    same(got, reference(store, q, uid, 10))
    conn.close()
    # Re-derivation: every row re-derived (here under the same version) and flipped in gets
    # a new seq; readers follow.
    version = store.db.dictionary.version
    assert maintenance.rederive(store, version, progress=False) > 0
    add(store, "u1", "u1-c0", ["zorblax guitar after the re-derivation"])
    assert maintenance.flip(store, version) > 0
    # The re-derived rows are chained at once, not left for every chain reader to derive.
    assert store.db.translated().execute("SELECT seq FROM derived").fetchone() == (
        store.db.translated().execute("SELECT max(seq) FROM retrieval").fetchone())
    got = ranked(sc.search(q, uid, 10))
    same(got, reference(store, q, uid, 10))
    fresh = scan.Scanner(store, store_rows=store_rows)
    assert ranked(fresh.search(q, uid, 10)) == got  # a cold process gets the same answer
    conn = opened_other(store.path)
    assert {v for (v,) in conn.execute("SELECT DISTINCT version FROM retrieval")} == {
        store.db.dictionary.version}
    conn.close()


def postings(arena: arena.Arena) -> np.ndarray:
    """Every posting of the arena as (global row, term, tf), sorted, whatever the segments."""
    parts = []
    for seg in arena.segments:
        if seg.terms is not None:
            rows = seg.rows.astype(np.int64) + seg.start
            terms = np.repeat(seg.terms, np.diff(seg.ptr))
        else:
            rows = np.repeat(np.arange(seg.n), np.diff(seg.row_ptr)) + seg.start
            terms = seg.row_terms
        parts.append(np.stack([rows, terms.astype(np.int64), seg.tf.astype(np.int64)], 1))
    out = np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)
    return out[np.lexsort(out.T[::-1])]


def same_arena(a: arena.Arena, b: arena.Arena) -> None:
    for name in ("seq", "user", "conv", "length", "prev", "next"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.n_rows, a.total_length, a.row_cursor) == (b.n_rows, b.total_length, b.row_cursor)
    assert a.df is not None and b.df is not None
    (ad, ah), (bd, bh) = a.df.table(), b.df.table()
    assert np.array_equal(ad, bd) and ah == bh
    assert np.array_equal(postings(a), postings(b))
    for seg in a.segments:
        assert seg.n <= arena.SEGMENT_ROWS
        if seg.terms is not None:  # term-major: terms ascend, each term's rows ascend
            assert (np.diff(seg.terms) > 0).all()
            for lo, hi in zip(seg.ptr[:-1], seg.ptr[1:], strict=True):
                assert (np.diff(seg.rows[lo:hi].astype(np.int64)) > 0).all()
    assert [s.start for s in a.segments] == list(np.cumsum([0] + [s.n for s in a.segments]))[:-1]


@pytest.mark.parametrize("layout", [arena.TERMS, arena.ROWS])
def test_catch_up_after_many_inserts_and_purges_equals_a_fresh_arena(
        store: Store, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 23)  # every catch-up appends, most merge
    monkeypatch.setattr(view.Frequencies, "FOLD_AT", 9)  # and frequencies fold
    rng = random.Random(17)
    sc = scan.Scanner(store, store_rows=0, layout=layout, threads=2)
    users = [store.user_id(f"u{i}") for i in range(3)]
    for step in range(40):
        for _ in range(rng.choice([0, 1, 2, 5, 9, 30, 70])):
            user = f"u{rng.randrange(3)}"
            add(store, user, f"{user}-c{rng.randrange(3)}",
                [random_text(rng) + (" | " + random_text(rng) if rng.random() < 0.2 else "")],
                at=float(step))
        if rng.random() < 0.3:
            live = [i for (i,) in store.db.translated().execute("SELECT item_id FROM retrieval")]
            index.purge(store, rng.sample(live, min(len(live), rng.randint(1, 6))))
        sc.catch_up()
        fresh = scan.Scanner(store, store_rows=0, layout=layout)
        fresh.catch_up()
        a, b = sc.arena, fresh.arena
        live = a.user >= 0  # purged rows stay behind, invisible (user -1)
        assert np.array_equal(a.seq[live], b.seq)
        assert (a.n_rows, a.total_length) == (b.n_rows, b.total_length)
        assert a.df is not None and b.df is not None
        (ad, ah), (bd, bh) = a.df.table(), b.df.table()
        assert np.array_equal(ad, bd) and ah == bh
        if step % 8 == 7:
            q = " ".join(rng.choice(WORDS) for _ in range(3))
            uid = rng.choice([*users, None])
            same(ranked(sc.search(q, uid, 10)), reference(store, q, uid, 10))
            same(ranked(fresh.search(q, uid, 10)), reference(store, q, uid, 10))
    # Without purges in between, the caught-up arena is the fresh one, posting for posting.
    again = scan.Scanner(store, store_rows=0, layout=layout)
    again.catch_up()
    for _ in range(12):
        add(store, "u0", "u0-c0", [random_text(rng) for _ in range(rng.randint(1, 30))])
        again.catch_up()
    fresh = scan.Scanner(store, store_rows=0, layout=layout)
    fresh.catch_up()
    same_arena(again.arena, fresh.arena)


def test_merged_segments_equal_one_built_from_all_their_rows() -> None:
    rng = np.random.default_rng(5)

    def rows(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        row_len = rng.integers(0, 4, n)  # some rows hold no term
        terms = np.concatenate([np.sort(rng.choice(1 << 23, k, replace=False))
                                for k in row_len.tolist()] or [np.zeros(0)]).astype(np.int32)
        return row_len, terms, rng.integers(1, 256, terms.size).astype(np.uint8)

    # Up to a full segment: the last local row is 65535, the top of uint16.
    for n_old, n_new in ((0, 3), (5, 0), (1, 1), (40, 17), (40_000, 25_536)):
        a, b = rows(n_old), rows(n_new)
        for layout in (arena.TERMS, arena.ROWS):
            older = arena.build_segment(7, *a, layout)
            newer = arena.build_segment(7 + n_old, *b, layout)
            both = arena.build_segment(7, *(np.concatenate(x) for x in zip(a, b, strict=True)),
                                      layout)
            merged = arena.merge_segments(older, newer)
            assert (merged.start, merged.n) == (both.start, both.n)
            for name in ("terms", "ptr", "rows", "row_ptr", "row_terms", "tf"):
                x, y = getattr(merged, name), getattr(both, name)
                assert (x is None and y is None) or (np.array_equal(x, y) and x.dtype == y.dtype)


FILLER = ["we watched a movie about space last night", "my brother fixed the kitchen sink",
          "the bakery on main street closed early", "I finally finished that long novel",
          "our neighbour painted the fence green", "traffic was terrible this morning"]


def test_a_second_hop_is_reached_through_the_first_hops_words(store: Store) -> None:
    """The turn that answers a multi-hop question shares no word with it, only with the
    turn that does (bm25.fed_back): it moves up among its conversation's rows, which the
    table alone ranks (11th, behind turns about nothing near); another conversation's turn
    sharing those words is not pulled in."""
    texts = ["Melanie went camping at Yosemite with her nephew Bartholomew", *FILLER,
             "Bartholomew says the Yosemite rangers spotted a black bear", *FILLER]
    ids = add(store, "u", "c", texts)
    other = add(store, "u", "d", [*FILLER, "Bartholomew and Yosemite again", *FILLER])
    first, hop, elsewhere = ids[0], ids[len(FILLER) + 1], other[len(FILLER)]
    uid = store.user_id("u")
    question = "Where did Melanie go camping?"
    for params, at in ((bm25.Params(), 7), (bm25.Params(feedback=0.0), 10)):
        for rows in (0, 10**9):  # the arena, and a small memory read from the store
            found = [h.item_id for h in scan.Scanner(store, store_rows=rows, params=params)
                     .search(question, uid, 50)]
            assert (found[0], found.index(hop)) == (first, at)
            assert elsewhere not in found
            same(ranked(scan.Scanner(store, store_rows=rows, params=params)
                        .search(question, uid, 50)),
                 reference(store, question, uid, 50, params=params))


def test_pooled_visibility(store: Store) -> None:
    rng = random.Random(5)
    fill(store, rng, 150)
    users = {store.user_id(f"u{i}"): f"u{i}" for i in range(3)}
    private = scan.Scanner(store, store_rows=0)
    shared = scan.Scanner(store, store_rows=0, share_pool=True)
    for _ in range(30):
        q = " ".join(rng.choice(WORDS) for _ in range(3))
        for uid in users:
            assert all(h.user_id == uid for h in private.search(q, uid, 50))
            hits = shared.search(q, uid, 50)
            own = [h.user_id == uid for h in hits]
            assert own == sorted(own, reverse=True)  # own rows first, then the pool's


@pytest.mark.parametrize("turns", ["interleaved", "in-runs"])
@pytest.mark.parametrize("layout", [arena.TERMS, arena.ROWS])
def test_a_scan_for_one_user_of_many_scores_only_their_postings(
        sqlite_store: Store, layout: str, turns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten users: one user's search computes a contribution for their own postings only (not
    every user's), and still ranks exactly as the reference, whether their rows are scattered
    (a mask over the postings) or runs of consecutive rows (slices of each term's postings)."""
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 53)
    rng = random.Random(11)
    for i in range(300):
        user = f"u{rng.randrange(10) if turns == 'interleaved' else i // 30}"
        add(sqlite_store, user, f"{user}-c{rng.randrange(2)}", [random_text(rng)], at=float(i))
    one = bm25.Params(feedback=0.0)  # one scan: the feedback's second adds its own terms
    sc = scan.Scanner(sqlite_store, layout=layout, store_rows=0, threads=1, params=one)
    uid = sqlite_store.user_id("u3")
    computed: list[int] = []
    real = view.contributions

    def counted(q: bm25.Query, slot: np.ndarray, tf: np.ndarray,
                length: np.ndarray) -> np.ndarray:
        computed.append(slot.size)
        return real(q, slot, tf, length)

    monkeypatch.setattr(view, "contributions", counted)
    conn = sqlite_store.db.connection()
    for q in ["support group guitar", "dog cat painting", "memory arena"]:
        computed.clear()
        same(ranked(sc.search(q, uid, 10)), reference(sqlite_store, q, uid, 10, params=one))
        terms = set(sqlite_store.db.dictionary.ids(q).tolist())
        own = sum(len(terms.intersection(np.frombuffer(t, "<i4").tolist())) for (t,) in
                  conn.execute("SELECT terms FROM retrieval WHERE user_id = ?", (uid,)))
        assert sum(computed) == own


@pytest.mark.parametrize("layout", [arena.TERMS, arena.ROWS])
def test_scoring_only_the_visible_rows_ranks_as_scoring_every_row(
        sqlite_store: Store, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """View.visible_scores (arrays as long as the rows shown) against scoring every row and
    its context over the whole arena: the same hits, scores bit for bit, whoever asks, with
    a conversation, a time span, a shared pool or a pool of some users, after purges."""
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 41)
    rng = random.Random(23)
    for i in range(400):  # runs of one user's turns, and users interleaved
        user = f"u{i // 40 if i < 200 else rng.randrange(8)}"
        add(sqlite_store, user, f"{user}-c{rng.randrange(3)}", [random_text(rng)], at=float(i))
    live = [i for (i,) in sqlite_store.db.translated().execute("SELECT item_id FROM retrieval")]
    index.purge(sqlite_store, rng.sample(live, 25))  # dead rows leave their chains
    users = [sqlite_store.user_id(f"u{i}") for i in range(8)]
    pool = frozenset(users[2:5])
    conv = sqlite_store.conversation_id(users[1], "u1-c0", "anthropic")
    cases: list[dict] = [{"user_id": u} for u in [*users, None]] + [
        {"user_id": users[1], "conversation_id": conv}, {"user_id": users[6], "during": (250.0, 330.0)}]
    for q in ["support group guitar", "dog cat painting memory", "arena", "hiking the beach"]:
        for share, pool_of in ((False, None), (True, None), (True, lambda _u: pool)):
            results = []
            for below in (0.0, 2.0):  # never, always only the visible rows
                monkeypatch.setattr(view, "SCORE_VISIBLE_BELOW", below)
                sc = scan.Scanner(sqlite_store, layout=layout, store_rows=0, threads=1,
                                  share_pool=share, pool_of=pool_of)
                results.append([ranked(sc.search(q, limit=30, **c)) for c in cases])
            assert results[0] == results[1]
            if pool_of is None:
                for c, got in zip(cases, results[1], strict=True):
                    same(got, reference(sqlite_store, q, c["user_id"], 30, share=share,
                                        conversation_id=c.get("conversation_id"),
                                        during=c.get("during")))


@pytest.mark.parametrize("run_cost", [0, 10**9], ids=["slices", "mask"])
def test_visible_postings_against_a_plain_filter(run_cost: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """view.postings with a mask: the postings of the kept rows, term by term in row order,
    as a plain filter over every posting gives them, by slices of runs or by the mask, each
    row given as its index in the kept rows."""
    monkeypatch.setattr(view, "RUN_COST", run_cost)
    rng = np.random.default_rng(4)
    for _ in range(30):
        n = int(rng.integers(1, 400))
        row_len = rng.integers(0, 6, n)
        terms = np.concatenate([np.sort(rng.choice(40, int(k), replace=False))
                                for k in row_len]).astype(np.int32)
        tf = rng.integers(1, 9, terms.size).astype(np.uint8)
        seg = arena.build_segment(0, row_len, terms, tf, arena.TERMS)
        assert seg.terms is not None and seg.ptr is not None and seg.rows is not None
        hit = np.flatnonzero(rng.random(seg.terms.size) < 0.5)
        lo, hi = seg.ptr[hit], seg.ptr[hit + 1]
        keep = np.repeat(rng.random(n // 7 + 1) < 0.4, 7)[:n]  # runs of kept rows
        keep[rng.integers(0, n, 3)] ^= True  # and a few lone ones
        kept = np.flatnonzero(keep)
        at, freq, slot = view.postings(seg.rows, seg.tf, lo, hi, hit, (keep, kept))
        got = kept[at], freq, slot  # each posting's row as its index in the kept rows
        want: list[list[int]] = [[], [], []]
        for j, a, b in zip(hit.tolist(), lo.tolist(), hi.tolist(), strict=True):
            for x in range(a, b):
                if keep[seg.rows[x]]:
                    for column, value in zip(want, (seg.rows[x], seg.tf[x], j), strict=True):
                        column.append(int(value))
        assert [g.tolist() for g in got] == want


def test_empty_memory_and_empty_queries(store: Store) -> None:
    for sr in (0, 10**9):
        sc = scan.Scanner(store, store_rows=sr)
        assert sc.search("anything at all", None, 10) == []
    add(store, "u0", "c", ["support group"])
    for sr in (0, 10**9):
        sc = scan.Scanner(store, store_rows=sr)
        assert sc.search("", None, 10) == []
        assert sc.search("   ", None, 10) == []
        assert sc.search("the of and", None, 10) == []  # only stop words
        assert sc.search("quuxwordneverseen", None, 10) == []
        assert sc.search("support", None, 0) == []
        assert [h.text for h in sc.search("support", None, 10)] == ["support group"]


# ------------------------------------------------------------------------------ commands


def test_search_and_stats_commands(memory_at: Path | str, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from perpetuity_core.cli import main as cli

    # Only this module's commands: the test does not depend on the others importing.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["perpetuity_core.cli.search",
                                                "perpetuity_core.cli.memory"])
    path = memory_at
    store = open_memory(path)
    add(store, "alice", "c1", ["we adopted a dog named Biscuit", "the concert was loud"])
    store.close()
    assert cli.main(["search", "--db", str(path), "--json", "--user", "alice", "dog"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The next turn follows on conversational context (bm25.Params.after), behind it.
    assert [h["text"] for h in out["hits"]] == ["we adopted a dog named Biscuit",
                                                "the concert was loud"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("biscuit\nconcert\n\n"))
    assert cli.main(["search", "--db", str(path), "--limit", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [[h["text"] for h in x["hits"]] for x in lines] == [
        ["we adopted a dog named Biscuit"], ["the concert was loud"], []]
    assert cli.main(["search", "--db", str(path), "--user", "nobody", "dog"]) == 1
    capsys.readouterr()
    assert cli.main(["stats", "--db", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["users"], stats["messages"], stats["rows"]) == (1, 2, 2)
    assert stats["row_versions"] == {store.db.dictionary.version: 2} and stats["db_bytes"] > 0
    # The same verbs under their noun; the top-level names above are their aliases.
    assert cli.main(["memory", "search", "--db", str(path), "--json", "--user", "alice", "dog"]) == 0
    assert json.loads(capsys.readouterr().out)["hits"][0]["text"] == "we adopted a dog named Biscuit"
    assert cli.main(["memory", "stats", "--db", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 2


@needs_shared
def test_import_the_benchmark_formats(tmp_path: Path) -> None:
    from perpetuity_core.memory.jobs import importers

    store = open_memory(tmp_path / "m.db")
    lme = importers.run(store, "longmemeval",
                        SHARED / "longmemeval" / "longmemeval_s_one_question.json",
                        progress=False)
    assert lme.messages == lme.seen > 500 and lme.threads == 53
    beam = importers.run(store, "beam", SHARED / "beam-100k" / "1", progress=False)
    assert beam.messages > 100
    again = importers.run(store, "beam", SHARED / "beam-100k" / "1", progress=False)
    assert again.messages == 0  # re-sent history is recognised, nothing is written twice
    thread = next(importers.locomo(SHARED / "locomo" / "locomo10.json"))
    importers.write(store, thread)
    uid = store.user_id(thread.user_key)
    hits = scan.Scanner(store).search("When did Caroline go to the LGBTQ support group?",
                                      uid, 10)
    assert hits and all(h.user_id == uid for h in hits)
    evidence = thread.messages[thread.labels.index("D1:3")].parts[0].text
    assert evidence in [h.text for h in hits]
    store.close()


def test_import_claude_code_sessions(tmp_path: Path) -> None:
    from perpetuity_core.memory.jobs import importers

    project = tmp_path / "projects" / "-home-dev-app"
    project.mkdir(parents=True)
    lines = [
        {"type": "summary", "summary": "ignored"},
        {"type": "user", "uuid": "u1", "timestamp": "2025-01-02T03:04:05.000Z",
         "sessionId": "s1", "message": {"role": "user", "content": "why is the deploy slow"}},
        {"type": "assistant", "uuid": "a1", "timestamp": "2025-01-02T03:04:06.000Z",
         "message": {"id": "msg_1", "role": "assistant", "model": "claude-x",
                     "content": [{"type": "text", "text": "Let me check the pipeline."}]}},
        {"type": "assistant", "uuid": "a2", "timestamp": "2025-01-02T03:04:07.000Z",
         "message": {"id": "msg_1", "role": "assistant", "model": "claude-x",
                     "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                  "input": {"command": "cat deploy.yml"}}]}},
        {"type": "user", "uuid": "u2", "timestamp": "2025-01-02T03:04:08.000Z",
         "message": {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "t1", "content": "steps: cache miss"}]}},
        {"type": "user", "isSidechain": True, "message": {"role": "user", "content": "sub"}},
    ]
    (project / "s1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    store = open_memory(tmp_path / "m.db")
    out = importers.run(store, "claude-code", tmp_path / "projects", progress=False)
    assert (out.threads, out.messages) == (1, 3)  # the split reply folded into one message
    uid = store.user_id("claude-code:local")
    hits = scan.Scanner(store).search("deploy.yml cache", uid, 5)
    assert {h.role for h in hits} >= {"assistant", "user"}
    assert any("Bash" in h.text for h in hits)  # a tool call is found by its tool's name too
    assert importers.run(store, "claude-code", tmp_path / "projects", progress=False).messages == 0
    store.close()


def test_a_conversation_ranks_in_a_persons_memory_as_in_its_own(store: Store,
                                                                tmp_path: Path) -> None:
    """Pooled, a word the other conversations say often ("paint") weighs little, and one
    said only in this conversation ("lake") much, though this conversation says it in every
    other turn: its turns about the lake outranked the one about painting. The best row's
    conversation is ranked again by its own counts (scan._top), as a memory holding it alone
    ranks it (the fed terms at a negligible weight: the first rankings they come from
    differ)."""
    talk = ["Caroline: I paint pictures, mostly", "Caroline: the lake was calm",
            "Caroline: swimming in the lake", "Caroline: hi there",
            "Caroline: by the lake again", "Caroline: a lake day"]
    others = [f"we painted the {w} today" for w in WORDS[:40]] + FILLER * 4
    question = "Did Caroline paint at the lake?"
    params = bm25.Params(before=(), after=(), semantic=0.0, feedback=1e-9)
    alone = open_memory(tmp_path / "alone.db")
    try:
        add(alone, "u", "a", talk)
        want = [h.text for h in scan.Scanner(alone, params=params).search(question, None, 50)]
    finally:
        alone.close()
    add(store, "u", "b", others)
    add(store, "u", "a", talk)
    got = [h.text for h in scan.Scanner(store, one_person=True, params=params)
           .search(question, None, 50) if h.text in talk]
    assert got == want
    assert got[0] == talk[0]
