"""Train a Hugging Face causal LM with `transformers.Trainer` as a member of a swarm: the
Trainer's own loop, optimizer and schedule, plus neuronode's callback (docs/library.md; needs
`pip install '.[hf-trainer]'`).

The model starts from a model directory (config.json and model.safetensors, the same on every
member); the text is local (.txt files); the tokenizer is a directory AutoTokenizer loads, or
`bytes` (256 byte tokens). Declaring the tokenizer and --seq-len makes this member equivalent to
`neuronode start --task hf --task-option model=DIR,tokenizer=...,data=...` with the same
--seq-len, --batch-size and --inner-steps: both kinds train in one swarm.

    python examples/hf_trainer_swarm.py --model tiny-llama --data 'corpus/*.txt' --data-dir run-a \\
        --listen 127.0.0.1:7441 --rounds 3 --inner-steps 6

It prints one JSON line when done: round, param_digest, and the validation loss before and after.
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile

import torch
import transformers

from neuronode.library.hf import NeuronodeCallback
from neuronode.training.tokenizer import bytes_tokenizer


def windows(texts: list[str], tokenizer: transformers.PreTrainedTokenizerBase, seq_len: int) -> torch.Tensor:
    """The texts' token ids, each text ended by end-of-text, cut into (N, seq_len) windows."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    usable = len(ids) // seq_len * seq_len
    return torch.tensor(ids[:usable]).view(-1, seq_len)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors)")
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--data", required=True, help="glob of .txt files, one document a line")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--peers", default="")
    parser.add_argument("--swarm-id", default="neuronode-default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=6)
    parser.add_argument("--min-peers", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1, help="this member's data order")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tokenizer = bytes_tokenizer() if args.tokenizer == "bytes" else transformers.AutoTokenizer.from_pretrained(
        args.tokenizer, local_files_only=True)
    texts = [line for path in sorted(glob.glob(args.data)) for line in open(path, encoding="utf-8").read().splitlines()
             if line.strip()]
    held_out = max(1, len(texts) // 10)
    train, val = windows(texts[:-held_out], tokenizer, args.seq_len), windows(texts[-held_out:], tokenizer, args.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)

    def validate(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(m(input_ids=val, labels=val).loss)

    callback = NeuronodeCallback(tokenizer=tokenizer, seq_len=args.seq_len, validate=validate,
                                 data_dir=args.data_dir, listen=args.listen, peers=args.peers,
                                 swarm_id=args.swarm_id, rounds=args.rounds, inner_steps=args.inner_steps,
                                 min_peers=args.min_peers)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.rounds * args.inner_steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, seed=args.seed, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=Windows(train), callbacks=[callback])
        before = validate(model)  # round 0: the initial weights, every member's
        trainer.train()
    assert callback.swarm is not None
    status = callback.swarm.status()
    print(json.dumps({"round": status["round"], "param_digest": status["param_digest"],
                      "val_loss_before": before, "val_loss": status["val_loss"],
                      "contributors": status["last_round_contributor_ids"]}), flush=True)


if __name__ == "__main__":
    main()
