"""The store: the database it owns, its SQL per backend, the rows it keeps
(messages, items, users, conversations), the versioned dictionary, and capture."""
