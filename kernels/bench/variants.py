"""Every kernel-variants script in one GPU call (issue 41 item 5): each module's main(["--csv", CSV]).

    python -m dapo_kernels.bench.variants --csv OUT/kernels.csv [--only policy_loss,logprob]

MODULES: the loss's (kernels/bench/variants_policy_loss.py) and the LM head's (variants_logprob.py, from
another branch: run when it is installed, reported as absent otherwise). Exit status: the worst of the
modules run (1 when any failed or none could run).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import traceback

MODULES = {"policy_loss": "dapo_kernels.bench.variants_policy_loss", "logprob": "dapo_kernels.bench.variants_logprob"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", required=True, help="results CSV (appended to)")
    parser.add_argument("--only", default=",".join(MODULES), help="comma-separated: " + ",".join(MODULES))
    args = parser.parse_args(argv)
    status, ran = 0, 0
    for name in args.only.split(","):
        module_name = MODULES[name]
        if importlib.util.find_spec(module_name) is None:
            print(f"==== {name}: {module_name} is not installed here, skipped")
            continue
        print(f"==== {name}: {module_name}", flush=True)
        try:  # one module's failure must not cost the others' rows
            code = importlib.import_module(module_name).main(["--csv", args.csv])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            code = 1
        ran += 1
        status = max(status, int(code or 0))
    return status if ran else 1


if __name__ == "__main__":
    raise SystemExit(main())
