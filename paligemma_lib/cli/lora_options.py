# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""The `train` command's LoRA flags (--lora, --lora-r, --lora-alpha, --lora-targets,
--lora-tokens) and the LoraConfig they describe."""

from ..lora import LoraConfig
from ..trainable_tokens import TOKEN_GROUPS

# LoraConfig's rank and alpha; the command's targets are the decoder's layers
# ("language"), where LoraConfig's default also matches SigLIP's q/k/v
LORA_DEFAULTS = {
    "lora_r": LoraConfig.r,
    "lora_alpha": float(LoraConfig.alpha),
    "lora_targets": "language",
}

LORA_TARGETS = {  # --lora-targets shorthands
    # chapter 10's default names, in the decoder only (SigLIP has q/k/v_proj too)
    "language": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj"
    r"|down_proj)",
    "all": "all-linear",  # PEFT's: every Linear but the LM head
}


def add_lora_arguments(parser) -> None:
    parser.add_argument(
        "--lora",
        action="store_true",
        help="with --model: train a LoRA adapter (chapter 10) and leave the model "
        "frozen; the output folder gets the adapter, in PEFT's format",
    )
    parser.add_argument(
        "--lora-r",
        type=int,
        default=None,
        help=f"with --lora: the adapter's rank (default: {LORA_DEFAULTS['lora_r']})",
    )
    parser.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="with --lora: the update is scaled by alpha/r "
        f"(default: {LORA_DEFAULTS['lora_alpha']})",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora: the layers adapted: 'language' (the decoder's attention "
        "and MLP), 'all' (every Linear but the LM head, the vision tower's too), or "
        f"comma-separated module names (default: {LORA_DEFAULTS['lora_targets']})",
    )
    parser.add_argument(
        "--lora-tokens",
        default=None,
        help="with --lora: also train these rows of the token table (embedding and "
        "tied LM head; PEFT's trainable_token_indices): 'seg' (the 128 <seg> "
        "pieces), 'loc' (the 1,024 <loc> pieces) or 'seg,loc'. Default: none",
    )
    parser.add_argument(
        "--from-adapter",
        default=None,
        metavar="NAME|DIR",
        help="with --lora: start from this saved adapter (a folder, or a shipped "
        "one: receipts, segment) and train it further; --lora-r, --lora-alpha and "
        "--lora-targets default to its own; --lora-tokens adds rows it did not train",
    )


def lora_settings(args):
    """The LoraConfig that --lora-r, --lora-alpha and --lora-targets describe (None
    without --lora, which they and --lora-tokens must then not be given with); the
    --lora-tokens groups are checked here, their ids found in the model's tokenizer
    when it loads"""
    flags = [*LORA_DEFAULTS, "lora_tokens", "from_adapter"]
    given = [name for name in flags if getattr(args, name) is not None]
    if not args.lora:
        if given:
            names = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(
                f"{names} shape a LoRA adapter: add --lora to train one (without "
                "--lora, --model fine-tunes every weight)"
            )
        return None
    if args.lora_tokens is not None:
        if getattr(args, "fsdp", False):  # gathered_model re-ties a plain head
            raise ValueError(
                "--lora-tokens with --fsdp is not supported: train the token rows "
                "without --fsdp (DDP under torchrun, or one process)"
            )
        groups = [g.strip() for g in args.lora_tokens.split(",")]
        if not set(groups) <= set(TOKEN_GROUPS) or len(set(groups)) < len(groups):
            raise ValueError(
                f"--lora-tokens {args.lora_tokens}: choose 'seg', 'loc' or 'seg,loc' "
                "(the <seg> or <loc> pieces' rows)"
            )
    saved = None
    if args.from_adapter is not None:  # its own settings, unless given
        from ..adapters import check_adapter
        from .adapter_checks import adapter_folder

        _, saved = check_adapter(adapter_folder(args.from_adapter, "--from-adapter"))
        for name, value in [("lora_r", saved.r), ("lora_alpha", saved.alpha)]:
            if getattr(args, name) is None:
                setattr(args, name, value)
    for name, value in LORA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    targets = LORA_TARGETS.get(args.lora_targets)
    if saved is not None and "lora_targets" not in given:
        targets = saved.target_modules  # the saved adapter's, as it wrote them
    if targets is None:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=targets)
