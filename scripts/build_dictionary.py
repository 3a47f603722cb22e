#!/usr/bin/env python3
"""Rebuild the retrieval dictionary (perpetuity_core/data/retrieval-dictionary.json.gz).

    scripts/build_dictionary.py [CORPUS_DIR] [--min-count N] [--out PATH]

CORPUS_DIR defaults to ../shared/data (LoCoMo, BEAM, LongMemEval) and may also hold any *.txt
or *.jsonl files. The version string is a digest of the result, so the same corpus gives the
same version, and rows derived with an older dictionary can be recognised and re-derived.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.storage import dictionary  # noqa: E402


def corpus_texts(root: Path) -> Iterator[str]:
    for path in sorted(root.rglob("*")):
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8", errors="replace")
        elif path.suffix in (".json", ".jsonl"):
            if path.suffix == ".jsonl":
                for line in path.open(encoding="utf-8"):
                    yield from _strings(json.loads(line))
            else:
                yield from _strings(json.loads(path.read_text(encoding="utf-8")))


def _strings(value: object) -> Iterator[str]:
    """Every string leaf of a JSON document: dataset formats differ, their text is in strings."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("corpus", nargs="?", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "perpetuity_core" / "data" / dictionary.DATA_FILE))
    args = ap.parse_args()
    norm = dictionary.make_normalizer()
    pre = dictionary.make_pre_tokenizer()
    counts: Counter[str] = Counter()
    for text in corpus_texts(Path(args.corpus)):
        counts.update(w for w, _ in pre.pre_tokenize_str(norm.normalize_str(text)))
    data = dictionary.build(dict(counts), min_count=args.min_count)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(out, "wb", mtime=0) as f:  # mtime=0: same corpus, same bytes
        f.write(json.dumps(data, separators=(",", ":"), sort_keys=True).encode())
    print(json.dumps({"version": data["version"], "stems": len(data["stems"]),
                      "words": sum(counts.values()), "distinct": len(counts),
                      "bytes": out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
