"""The parts of ``benchmarks/quality.py`` (modules, not commands): ``corpus`` (its built-in
prompts over standard-library docstrings), ``settings`` (the settings grid, the targets and
the table), ``oracle`` (oracle recompute selections, an upper bound); and its subcommands'
code: ``report`` (``quality.py prose``: the fidelity report on a split of the real-prose
suite, in saved slices, against the order floor), ``suite`` with ``rst`` (``quality.py
prose-suite``: builds ``benchmarks/data/prose/`` from Python's library reference) and
``demo`` (``quality.py demo``: the demo's questions, each setting against full attention).
"""
