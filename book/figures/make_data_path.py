"""Draw chapter 0's map of PaliGemma's data path.

python book/figures/make_data_path.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

HERE = Path(__file__).parent
VISION, PROJ, TEXT, DATA = "#cfe3f7", "#fde2b8", "#d8f0d2", "#eeeeee"


def box(ax, x, y, w, h, title, detail, color):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            fc=color,
            ec="#444",
            lw=1,
        )
    )
    ax.text(
        x + w / 2,
        y + h * 0.64,
        title,
        ha="center",
        va="center",
        fontsize=10,
        weight="bold",
    )
    ax.text(
        x + w / 2,
        y + h * 0.28,
        detail,
        ha="center",
        va="center",
        fontsize=8,
        color="#333",
    )


def arrow(ax, start, end, label=None):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            lw=1.2,
            color="#333",
        )
    )
    if label:
        ax.text(
            (start[0] + end[0]) / 2,
            (start[1] + end[1]) / 2 + 0.12,
            label,
            ha="center",
            fontsize=7.5,
            color="#555",
        )


def main():
    fig, ax = plt.subplots(figsize=(12, 5.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 5.6)
    ax.axis("off")

    # Row 1: the image side.
    y1, h = 3.9, 1.1
    box(
        ax,
        0.1,
        y1,
        1.9,
        h,
        "image",
        "any size and mode\n-> RGB 224 x 224",
        DATA,
    )
    box(
        ax,
        2.5,
        y1,
        2.0,
        h,
        "patches",
        "16 x 16 = 256 patches\nof 14 x 14 x 3 pixels",
        DATA,
    )
    box(
        ax,
        5.0,
        y1,
        2.5,
        h,
        "SigLIP vision tower",
        "27 encoder layers, width 1152\n(ch. 1-3)",
        VISION,
    )
    box(ax, 8.0, y1, 1.7, h, "projector", "Linear 1152 -> 2048\n(ch. 7)", PROJ)
    box(
        ax,
        10.2,
        y1,
        1.7,
        h,
        "image tokens",
        "256 vectors\nof width 2048",
        PROJ,
    )
    for a, b in [(2.0, 2.5), (4.5, 5.0), (7.5, 8.0), (9.7, 10.2)]:
        arrow(ax, (a, y1 + h / 2), (b, y1 + h / 2))

    # Row 2: the sequence the decoder reads.
    y2 = 2.15
    cells = [
        ("<image> x 256", 2.6, PROJ),
        ("<bos>", 0.8, DATA),
        ('prefix: "caption en"', 2.2, DATA),
        ('"\\n"', 0.6, DATA),
        ('suffix: "a house ..." <eos>', 2.7, TEXT),
    ]
    x = 0.9
    starts = []
    for text, w, color in cells:
        ax.add_patch(
            FancyBboxPatch(
                (x, y2),
                w - 0.05,
                0.6,
                boxstyle="square,pad=0",
                fc=color,
                ec="#444",
                lw=0.8,
            )
        )
        ax.text(
            x + w / 2, y2 + 0.3, text, ha="center", va="center", fontsize=8.5
        )
        starts.append(x)
        x += w
    ax.text(
        0.85,
        y2 + 0.3,
        "sequence",
        ha="right",
        va="center",
        fontsize=9,
        weight="bold",
    )
    arrow(
        ax,
        (11.05, y1),
        (0.9 + 1.3, y2 + 0.62),
        "projected features fill the <image> positions",
    )
    prefix_end = starts[4]
    ax.annotate(
        "",
        (0.9, y2 - 0.12),
        (prefix_end - 0.05, y2 - 0.12),
        arrowprops=dict(arrowstyle="<->", color="#1f5fa8"),
    )
    ax.text(
        (0.9 + prefix_end) / 2,
        y2 - 0.35,
        "prefix: every token sees every other (bidirectional)",
        ha="center",
        fontsize=8,
        color="#1f5fa8",
    )
    ax.annotate(
        "",
        (prefix_end, y2 - 0.12),
        (x - 0.05, y2 - 0.12),
        arrowprops=dict(arrowstyle="<->", color="#2e7d32"),
    )
    ax.text(
        (prefix_end + x) / 2,
        y2 - 0.35,
        "suffix: causal, each token sees only the past",
        ha="center",
        fontsize=8,
        color="#2e7d32",
    )

    # Row 3: the decoder and its output.
    y3 = 0.2
    box(
        ax,
        2.2,
        y3,
        3.6,
        1.05,
        "Gemma-2B decoder",
        "18 layers, width 2048, 8 query heads, 1 KV head\n(ch. 4-5, 7-8)",
        TEXT,
    )
    box(
        ax,
        6.6,
        y3,
        2.4,
        1.05,
        "next-token logits",
        "over 257,216 tokens",
        TEXT,
    )
    box(
        ax,
        9.6,
        y3,
        2.3,
        1.05,
        "suffix text",
        "generated one token\nat a time (ch. 8)",
        DATA,
    )
    arrow(ax, (4.0, y2 - 0.5), (4.0, y3 + 1.07))
    arrow(ax, (5.8, y3 + 0.52), (6.6, y3 + 0.52))
    arrow(ax, (9.0, y3 + 0.52), (9.6, y3 + 0.52))
    ax.set_title(
        "PaliGemma-3B-224: from an image and a prompt to an answer",
        fontsize=12,
        weight="bold",
    )
    fig.savefig(HERE / "data_path.svg", bbox_inches="tight")


if __name__ == "__main__":
    main()
