"""Import every module of the installed ``lazyllm`` and run one ``generate`` on the default model.

Run by scripts/check_wheel.sh in a clean virtual environment, from a folder outside the source
tree, so only the installed wheel can answer. A module of ``lazyllm.integrations`` whose
extra is not installed must say so (``MissingExtraError``); any other failure fails the check.
"""
import importlib
import os
import sys

import lazyllm
from lazyllm.extras import MissingExtraError

root = os.path.dirname(lazyllm.__file__)
assert "site-packages" in root, f"lazyllm came from {root}, not from the installed wheel"
modules = []
for folder, subfolders, files in os.walk(root):
    subfolders[:] = [d for d in subfolders if d != "__pycache__"]
    package = os.path.relpath(folder, os.path.dirname(root)).replace(os.sep, ".")
    modules += [package if f == "__init__.py" else f"{package}.{f[:-3]}"
                for f in files if f.endswith(".py") and f != "__main__.py"]
failed, missing_extra = {}, []
for name in sorted(modules):
    try:
        importlib.import_module(name)
    except MissingExtraError:
        if not name.startswith("lazyllm.integrations."):
            failed[name] = "an extra is missing for a core module"
        missing_extra.append(name)
    except Exception as e:  # noqa: BLE001 - every failure is reported
        failed[name] = f"{type(e).__name__}: {e}"
print(f"import_all: {len(modules) - len(missing_extra) - len(failed)} modules imported, "
      f"{len(missing_extra)} integrations need an extra that is not installed, {len(failed)} failed")
for name, why in failed.items():
    print(f"  {name}: {why}")
if failed:
    sys.exit(1)
out = lazyllm.LazyLLM(progress=False).generate("What colour is Sorna glass?", chunks=["Sorna glass is blue."],
                                               max_new_tokens=4)
print(f"import_all: generate gave {out.usage.completion_tokens} tokens: {out.text!r}")
sys.exit(0 if out.usage.completion_tokens > 0 else 1)
