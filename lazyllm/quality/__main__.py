"""``python -m lazyllm.quality cases.jsonl``: see ``lazyllm.quality.cli``."""
from .cli import main

main()
