"""Fine-tune a tiny MoE model with transformers' Trainer (or TRL's SFTTrainer) and Sonar, on Alpaca data.

    python examples/hf_trainer_alpaca.py                          # tiny Qwen3-MoE, built-in data, Trainer
    python examples/hf_trainer_alpaca.py --trainer sft            # TRL's SFTTrainer instead
    python examples/hf_trainer_alpaca.py --data my_alpaca.jsonl --model tiny-olmoe --compiler inductor

Everything runs locally: the model is built from a tiny config, the data is the project's synthetic
Alpaca-format set (or your own Alpaca .json/.jsonl file) and the tokenizer is the built-in byte
tokenizer. Needs the extra: pip install 'sonar-fx[hf]'.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import sonar_fx
from sonar_fx.data import (
    ByteTokenizer,
    collate,
    encode_records,
    load_records,
    split_records,
    synthetic_records,
)
from sonar_fx.integrations.hf import SonarTrainer, byte_tokenizer, sonar_config
from sonar_fx.models import TINY_MODELS, build_model


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny-qwen3moe", choices=[m for m in TINY_MODELS if m != "tiny-reference"]
    )
    parser.add_argument("--trainer", default="trainer", choices=["trainer", "sft"])
    parser.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--data", default=None, help="an Alpaca .json/.jsonl file (default: built-in set)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--records", type=int, default=600, help="size of the built-in data set")
    parser.add_argument("--held-out", type=int, default=64, help="records kept out of training for eval")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--out", default="results/hf_trainer_alpaca")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    opts = parse_args(argv)
    records = load_records(opts.data) if opts.data else synthetic_records(opts.records)
    train, held_out = split_records(records, n_train=len(records) - opts.held_out, n_held_out=opts.held_out)

    fields = dict(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=8, learning_rate=opts.lr, warmup_steps=max(1, opts.steps // 10),
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=max(1, opts.steps // 10),
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=True, seed=0,
    )  # fmt: skip
    if opts.trainer == "sft":
        trainer = _sft_trainer(opts, fields, train, held_out)
    else:
        from transformers import TrainingArguments

        args = TrainingArguments(**fields)
        model = build_model(opts.model)
        model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=opts.compiler)
        tokenizer = ByteTokenizer()

        def collate_batch(batch):
            return collate(batch, tokenizer.pad_id)

        trainer = SonarTrainer(
            model=model,
            args=args,
            train_dataset=encode_records(train, tokenizer, opts.max_len).examples,
            eval_dataset=encode_records(held_out, tokenizer, opts.max_len).examples,
            data_collator=collate_batch,
        )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    report = trainer.sonar.report()
    perplexity = f"{math.exp(before):.1f} -> {math.exp(after):.1f}"
    print(f"held-out loss {before:.4f} -> {after:.4f} (perplexity {perplexity})")
    print(
        f"expert updates in graph {report['updates_in_graph']}, by hook {report['updates_by_hook']}, "
        f"graphs compiled {report['graphs_compiled']}, recompiles {report['recompiles']}, "
        f"fallbacks {report['fallbacks']}"
    )
    return {"eval_loss_before": before, "eval_loss_after": after}


def _sft_trainer(opts, fields, train, held_out):
    from datasets import Dataset
    from trl import SFTConfig

    from sonar_fx.integrations.sft import SonarSFTTrainer, prompt_completion

    # TRL turns bf16 autocast on by default; on CPU it is slow and buys nothing for a tiny model.
    args = SFTConfig(**fields, max_length=opts.max_len, bf16=False)
    model = build_model(opts.model)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=opts.compiler)
    return SonarSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(prompt_completion(train)),
        eval_dataset=Dataset.from_list(prompt_completion(held_out)),
        processing_class=byte_tokenizer(),
    )


if __name__ == "__main__":
    main()
