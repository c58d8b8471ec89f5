"""Draw the handwritten number README shows with nano-real: real_number.png.

python book/figures/make_real_number.py

The picture is a test example of chapter 12.2's handwriting world (real MNIST
digits, none of them seen in training), drawn by `make_example`. From test seed
START on, the first three-digit number that the shipped `nano-real` reads right
is the one saved, and its seed printed; nano-real reads 84% of such numbers
right (chapter 12.2), and the README says so beside it.
tests/test_cli.py reads the picture with the same command.
"""

from pathlib import Path

import paligemma_lib.real_images  # noqa: F401  (adds the handwriting world)
from paligemma_lib import PaliGemmaProcessor, answer, load_pretrained
from paligemma_lib.data import SyntheticDataset

HERE = Path(__file__).parent
START = 400  # test examples from here on: past the 300 chapter 12.2 graded


def main() -> None:
    model = load_pretrained("nano-real")
    processor = PaliGemmaProcessor.from_pretrained("nano-real")
    data = SyntheticDataset("handwriting", "test", size=START + 200)
    for index in range(START, START + 200):
        ex = data.example(index)
        if len(ex.answer) == 3 and answer(
            model, processor, ex.image, ex.prompt
        ) == (ex.answer):
            ex.image.save(HERE / "real_number.png")
            print(
                f"test example {index} (seed {data.seeds[index]}): {ex.answer}"
            )
            return
    raise SystemExit("no three-digit number of 200 is read right")


if __name__ == "__main__":
    main()
