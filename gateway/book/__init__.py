"""The write path: every change of a task, decided by the machine (``gateway.machine``) inside one store
transaction, and what rides along with it.

- ``book.py``: the :class:`~gateway.book.book.Book` over the store: callback dedup, fencing, the
  notification outbox, cursor resume and result delivery (the rules; the statements are ``gateway.store``'s);
- ``committer.py``: group commit, many callbacks in one transaction;
- ``drain.py``: the notification drain's batches and their ``Idempotency-Key`` receipts;
- ``outcomes.py``: what a callback, a cancel or a delivery answers;
- ``tag_reads.py``: a tag's tasks and many resumes in one query;
- ``listeners.py``: who hears of the book's commits (the sweeper, the relay).

Modules here import their siblings, never this package: it re-exports nothing.
"""
