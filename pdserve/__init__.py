"""pdserve: disaggregated LLM serving (user-facing CLI and client).

The engine and everything the services share live in the top-level ``common`` package; the services in
``services``. This package holds only what a user runs: the ``pdserve`` command. It must import fast:
nothing here imports torch at module level.
"""

__version__ = "0.1.0"
