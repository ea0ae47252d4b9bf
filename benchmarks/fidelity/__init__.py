"""The real-prose fidelity tools behind ``benchmarks/quality.py``'s subcommands (modules, not
commands): ``report`` (``quality.py prose``: the fidelity report on a split of the suite, in
saved slices, against the order floor), ``suite`` with ``rst`` (``quality.py prose-suite``:
builds ``benchmarks/data/prose/`` from Python's library reference) and ``demo``
(``quality.py demo``: the demo's questions, each setting against full attention)."""
