"""Draw chapter 0's map of PaliGemma's data path.

python book/figures/make_data_path.py

The figure is drawn for the book's column: 5.6 inches, that is 538 CSS px
at its natural size (the SVG is sized in points, 72 to the inch, and a
browser shows a point as 4/3 px), with text of 9 pt or more (12 px and up
in the 688-px column, 7.6 px and up on a 390-px phone, where the figure
is shown 342 px wide). The data path snakes: the image side runs left to
right and back, so each row holds at most three boxes.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

HERE = Path(__file__).parent
VISION, PROJ, TEXT, DATA = "#cfe3f7", "#fde2b8", "#d8f0d2", "#eeeeee"
PREFIX_C, SUFFIX_C = "#1f5fa8", "#2e7d32"
W, H = 5.6, 4.5  # inches; the axes use inches as data units
TITLE, DETAIL = 10.5, 9  # font sizes in points


def box(ax, x, y, w, h, title, detail, color):
    """A rounded box, (x, y) its lower left corner, bold title over detail."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0,rounding_size=0.08",
            fc=color,
            ec="#444",
            lw=1,
        )
    )
    ax.text(
        x + w / 2,
        y + h - 0.07,
        title,
        ha="center",
        va="top",
        fontsize=TITLE,
        weight="bold",
    )
    ax.text(
        x + w / 2,
        y + 0.07,
        detail,
        ha="center",
        va="bottom",
        fontsize=DETAIL,
        color="#333",
        linespacing=1.15,
    )


def arrow(ax, start, end, color="#333", style="-|>"):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=12,
            lw=1.2,
            color=color,
            shrinkA=0,
            shrinkB=0,
        )
    )


def main():
    fig = plt.figure(figsize=(W, H))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")
    ax.text(
        W / 2,
        H - 0.05,
        "PaliGemma-3B-224: from image and prompt to answer",
        ha="center",
        va="top",
        fontsize=11,
        weight="bold",
    )

    # Rows 1 and 2: the image side, left to right and back.
    bh = 0.72  # box height
    y1 = H - 0.4 - bh
    box(
        ax,
        0.05,
        y1,
        1.5,
        bh,
        "image",
        "any size and mode\n-> RGB 224 x 224",
        DATA,
    )
    box(
        ax,
        1.85,
        y1,
        1.65,
        bh,
        "patches",
        "a 16 x 16 grid of\n14 x 14-px patches",
        DATA,
    )
    box(
        ax,
        3.8,
        y1,
        1.75,
        bh,
        "SigLIP tower",
        "27 encoder layers\nof width 1152 (ch. 1-3)",
        VISION,
    )
    arrow(ax, (1.55, y1 + bh / 2), (1.85, y1 + bh / 2))
    arrow(ax, (3.5, y1 + bh / 2), (3.8, y1 + bh / 2))

    y2 = y1 - 0.3 - bh
    box(
        ax,
        3.8,
        y2,
        1.75,
        bh,
        "projector",
        "Linear 1152 -> 2048\n(ch. 7)",
        PROJ,
    )
    box(
        ax,
        0.05,
        y2,
        1.5,
        bh,
        "image tokens",
        "256 vectors\nof width 2048",
        PROJ,
    )
    arrow(ax, (4.675, y1), (4.675, y2 + bh))
    arrow(ax, (3.8, y2 + bh / 2), (1.55, y2 + bh / 2))

    # Row 3: the one sequence the decoder reads.
    sh = 0.34  # strip height
    y3 = y2 - 0.42 - sh
    cells = [
        ("<image> x 256", 1.5, PROJ),
        ("<bos>", 0.6, DATA),
        ('"caption en"', 1.15, DATA),
        ('"\\n"', 0.45, DATA),
        ('"a house ..." <eos>', 1.8, TEXT),
    ]
    x = 0.05
    starts = []
    for text, w, color in cells:
        ax.add_patch(
            FancyBboxPatch(
                (x, y3),
                w,
                sh,
                boxstyle="square,pad=0",
                fc=color,
                ec="#444",
                lw=0.8,
            )
        )
        ax.text(
            x + w / 2,
            y3 + sh / 2,
            text,
            ha="center",
            va="center",
            fontsize=DETAIL,
        )
        starts.append(x)
        x += w
    end = x
    arrow(ax, (0.8, y2), (0.8, y3 + sh))
    ax.text(
        0.92,
        (y2 + y3 + sh) / 2,
        "fill the <image> positions",
        ha="left",
        va="center",
        fontsize=DETAIL,
        color="#555",
    )
    # Who sees whom, under the strip.
    yb = y3 - 0.1
    prefix_end = starts[4]
    arrow(ax, (0.05, yb), (prefix_end, yb), PREFIX_C, "<->")
    arrow(ax, (prefix_end, yb), (end, yb), SUFFIX_C, "<->")
    ax.text(
        (0.6 + prefix_end) / 2,
        yb - 0.07,
        "prefix: every token sees\nevery other (bidirectional)",
        ha="center",
        va="top",
        fontsize=DETAIL,
        color=PREFIX_C,
        linespacing=1.15,
    )
    ax.text(
        (prefix_end + end) / 2,
        yb - 0.07,
        "suffix: causal, each token\nsees only the past",
        ha="center",
        va="top",
        fontsize=DETAIL,
        color=SUFFIX_C,
        linespacing=1.15,
    )

    # Row 4: the decoder and its output.
    y4, bh = 0.05, 0.9
    box(
        ax,
        0.05,
        y4,
        2.05,
        bh,
        "Gemma-2B decoder",
        "18 layers, width 2048,\n8 query heads, 1 KV head\n(ch. 4-5, 7-8)",
        TEXT,
    )
    box(
        ax,
        2.35,
        y4,
        1.5,
        bh,
        "next-token\nlogits",
        "over 257,216\ntokens",
        TEXT,
    )
    box(
        ax,
        4.1,
        y4,
        1.45,
        bh,
        "suffix text",
        "one token at\na time (ch. 8)",
        DATA,
    )
    arrow(ax, (0.3, yb - 0.06), (0.3, y4 + bh))
    arrow(ax, (2.1, y4 + bh / 2), (2.35, y4 + bh / 2))
    arrow(ax, (3.85, y4 + bh / 2), (4.1, y4 + bh / 2))
    fig.savefig(HERE / "data_path.svg", metadata={"Date": None})


if __name__ == "__main__":
    main()
