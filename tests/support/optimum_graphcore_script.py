"""optimum-graphcore's IPUTrainer on a small BERT, run by tests/programs/test_optimum_graphcore.py.

As `python -m poptorch_lite run tests/support/optimum_graphcore_script.py OUT.json`
(unmodified PopTorch client code: nothing here names poptorch_lite).

It trains 3 epochs of synthetic sequence classification with IPUConfig(layers_per_ipu=[1, 1],
gradient_accumulation_steps=4, device_iterations=2) and evaluates. Then it replays the same
training in plain PyTorch (the trainer's own optimizer on a copy of the initial model, the
batches and learning rates the trainer used, micro-batch by micro-batch) and evaluates the
trained model in plain PyTorch; it writes the logged losses, both evaluation losses and the
largest difference between the two trainings' weights.
"""

import copy
import json
import sys

import torch
from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments
from transformers import BertConfig, BertForSequenceClassification


class Synthetic(torch.utils.data.Dataset):
    """Sequences of 16 tokens; the label says whether the first token is above 50."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
                "token_type_ids": torch.zeros(16, dtype=torch.long), "labels": self.labels[i]}


def main(out_path):
    torch.manual_seed(0)
    # transformers' default return_dict=True: the model returns a ModelOutput, a dict
    # subclass that transformers 4.29 does not register with pytree (rebuilt each call).
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0,  # no dropout: masks are
                        attention_probs_dropout_prob=0.0)  # drawn per micro-batch here
    model = BertForSequenceClassification(config)
    initial = copy.deepcopy(model)
    ipu_config = IPUConfig(layers_per_ipu=[1, 1], gradient_accumulation_steps=4, device_iterations=2)
    args = IPUTrainingArguments(output_dir=str(out_path) + ".trainer", per_device_train_batch_size=2,
                                per_device_eval_batch_size=2, num_train_epochs=3, learning_rate=1e-3,
                                logging_steps=1, report_to="none", dataloader_drop_last=True,
                                fp32=True, save_strategy="no", seed=0)
    eval_data = Synthetic(32, 2)
    trainer = Recording(model=model, ipu_config=ipu_config, args=args,
                        train_dataset=Synthetic(64, 1), eval_dataset=eval_data)
    train = trainer.train()
    evaluation = trainer.evaluate()
    trained = trainer.model.eval()  # the host copy of the trained weights, in plain PyTorch
    with torch.no_grad():
        plain = [trained(**{k: torch.stack([eval_data[i][k] for i in (j, j + 1)])
                            for k in eval_data[0]})[0].item() for j in range(0, 32, 2)]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    replayed = replay(initial, ipu_config, args, trainer.calls)
    diff = max((p - q).abs().max().item() for p, q in
               zip(trainer.model.parameters(), replayed.parameters()))
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "train_loss": train.training_loss, "steps": train.global_step,
                   "eval_loss": evaluation["eval_loss"], "plain_eval_loss": sum(plain) / len(plain),
                   "max_weight_difference": diff}, f)


class Recording(IPUTrainer):
    """IPUTrainer that records each call's combined batch and learning rates."""

    calls: list = []

    def training_step(self, model, inputs):
        self.calls.append(({k: v.clone() for k, v in inputs.items()},
                           [g["lr"] for g in self.optimizer.param_groups]))
        return super().training_step(model, inputs)


def replay(initial, ipu_config, args, calls):
    """The recorded training in plain PyTorch: each call is D=2 optimizer steps, each the mean
    gradient of G=4 micro-batches of 2 (PopTorch's [D, G, B] layout), with the trainer's own
    optimizer (PopTorch's AdamW without bias correction, its parameter groups)."""
    plain = IPUTrainer(model=initial, ipu_config=ipu_config, args=args)
    model, opt = plain.model.train(), plain.create_optimizer()
    D, G, B = 2, 4, 2
    for inputs, lrs in calls:
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        for d in range(D):
            opt.zero_grad()
            for g in range(G):
                rows = slice((d * G + g) * B, (d * G + g + 1) * B)
                model(**{k: v[rows] for k, v in inputs.items()})[0].backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(G)
            opt.step()
    return model


if __name__ == "__main__":
    main(sys.argv[1])
