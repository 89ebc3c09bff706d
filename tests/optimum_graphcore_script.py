"""optimum-graphcore's IPUTrainer on a small BERT, run by tests/test_optimum_graphcore.py as
`python -m poptorch_lite run tests/optimum_graphcore_script.py OUT.json` (unmodified PopTorch
client code: nothing here names poptorch_lite).

It trains 3 epochs of synthetic sequence classification with IPUConfig(layers_per_ipu=[1, 1],
gradient_accumulation_steps=4, device_iterations=2), evaluates, then evaluates the trained
model again in plain PyTorch, and writes the logged losses and both evaluation losses.
"""

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
    # return_dict=False: transformers 4.29's ModelOutput is a dict subclass that a wrapped
    # model must flatten (issue 20, part B, fixed beside this); tuples work everywhere.
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2,
                        return_dict=False)
    model = BertForSequenceClassification(config)
    ipu_config = IPUConfig(layers_per_ipu=[1, 1], gradient_accumulation_steps=4, device_iterations=2)
    args = IPUTrainingArguments(output_dir=str(out_path) + ".trainer", per_device_train_batch_size=2,
                                per_device_eval_batch_size=2, num_train_epochs=3, learning_rate=1e-3,
                                logging_steps=1, report_to="none", dataloader_drop_last=True,
                                fp32=True, save_strategy="no", seed=0)
    eval_data = Synthetic(32, 2)
    trainer = IPUTrainer(model=model, ipu_config=ipu_config, args=args,
                         train_dataset=Synthetic(64, 1), eval_dataset=eval_data)
    train = trainer.train()
    evaluation = trainer.evaluate()
    trained = trainer.model.eval()  # the host copy of the trained weights, in plain PyTorch
    with torch.no_grad():
        plain = [trained(**{k: torch.stack([eval_data[i][k] for i in (j, j + 1)])
                            for k in eval_data[0]})[0].item() for j in range(0, 32, 2)]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "train_loss": train.training_loss, "steps": train.global_step,
                   "eval_loss": evaluation["eval_loss"], "plain_eval_loss": sum(plain) / len(plain)},
                  f)


if __name__ == "__main__":
    main(sys.argv[1])
