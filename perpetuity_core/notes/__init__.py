"""Notes: a small, curated Markdown library of how hard problems got solved.

A notes root holds::

    <root>/notes/<slug>.md     one note per file, frontmatter + When/Procedure/Pitfalls/Verification
    <root>/INDEX.md            one line per active note, regenerated from frontmatter, with a budget
    <root>/.archive/           archived notes and curate snapshots; nothing is ever deleted

People edit these files by hand, so a note is kept as the text it was read from: a note nobody
changed is written back byte-identical, and a changed note has only the frontmatter lines of the
changed keys rewritten (its body is re-rendered only when the body itself changed). Files whose
names start with `_` (such as the shipped `_example.md`) are templates and are never loaded.

Four jobs, all deterministic and free of model calls:

- recall(root, task)      terms from the task, matched against tags (weighted) and bodies;
- capture(root, fields)   writes or patches exactly one note, after a credential scan;
- curate(root, today)     snapshot, age, consolidate, reindex; never deletes, never touches a
                          pinned or hand-authored note;
- reindex(root)           INDEX.md from frontmatter, reporting (never widening) the budget.

Errors are `NoteError` (a `PerpetuityError`); a note that looks like it holds a secret is refused
with `CredentialError`, which names the kind of secret and where, never the secret itself.
"""

from perpetuity_core.memory.storage.secrets import CredentialFinding, scan_credentials, secret_kind
from perpetuity_core.notes.curate import (
    ARCHIVE_AFTER_DAYS,
    STALE_AFTER_DAYS,
    CurateSummary,
    curate,
)
from perpetuity_core.notes.library import (
    INDEX_HEADER,
    INDEX_MAX_CHARS,
    INDEX_MAX_LINES,
    IndexReport,
    find_note,
    index_line,
    index_lines,
    load_notes,
    notes_root,
    parse_day,
    reindex,
    render_index,
    save_note,
    slugify,
)
from perpetuity_core.notes.model import (
    ARCHIVE_DIR,
    CONFIDENCE,
    FIELDS,
    INDEX_FILE,
    NOTES_DIR,
    ORIGINS,
    SECTIONS,
    STATES,
    CredentialError,
    Note,
    NoteError,
    parse_note,
    render_note,
    split_sections,
)
from perpetuity_core.notes.recall import (
    BODY_WEIGHT,
    DESCRIPTION_WEIGHT,
    RECALL_MAX_NOTES,
    RECALL_MIN_SCORE,
    TAG_WEIGHT,
    RecalledNote,
    RecallResult,
    cited_notes,
    mark_used,
    recall,
)
from perpetuity_core.notes.similarity import (
    LINE_DUPLICATE_THRESHOLD,
    SIMILARITY_THRESHOLD,
    STOP_WORDS,
    TAG_SHARE,
    body_terms,
    jaccard,
    merge_bodies,
    similarity,
    tag_set,
    tag_terms,
    terms,
)
from perpetuity_core.notes.write import (
    CAPTURE_RULES,
    CAPTURE_TOOL_NAME,
    CAPTURE_TOOL_SCHEMA,
    CaptureResult,
    capture,
    note_from_fields,
)
