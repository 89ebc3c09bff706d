"""Lightning's IPUStrategy on a small classifier, run by tests/programs/test_lightning.py as
`python -m poptorch_lite run tests/support/lightning_script.py STAGES FLAVOUR OUT.json` (unmodified
PopTorch client code: nothing here names poptorch_lite). FLAVOUR `graphcore` is
lightning-graphcore 0.1.0's IPUAccelerator and IPUStrategy, `lightning` pytorch-lightning 2.0.9's
own (`accelerator="ipu"`). Lightning 2.0.9 turns a torch DataLoader into a poptorch.DataLoader
for its own accelerator only, so with `graphcore` the module returns poptorch.DataLoaders of the
strategy's options, as Lightning's IPU guide shows.

It fits 2 epochs (SGD with a StepLR schedule, validation each epoch after the sanity check),
then validates, tests and predicts, on 1 IPU (STAGES=1) or as a 2-stage pipeline
(STAGES=2, accumulate_grad_batches=3, device_iterations=2: PopTorch's minimums). Then it replays the training in plain PyTorch (one
step per combined batch on the mean of its micro-batch losses) and writes the largest
differences of the weights and of every evaluation output from plain PyTorch.
"""

import copy
import json
import sys

import lightning_graphcore
import poptorch
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

B, ROWS, EPOCHS, LR = 4, 48, 2, 0.1


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 4, generator=g),
                                          torch.randint(0, 2, (ROWS,), generator=g))


class Net(pl.LightningModule):
    def __init__(self, stages):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        if stages == 2:
            poptorch.BeginBlock(self.b, ipu_id=1)
        self.seen = {"validate": [], "test": []}

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    test_step = validation_step

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        if not self.trainer.sanity_checking and self.trainer.state.fn == "validate":
            self.seen["validate"].append(outputs)

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen["test"].append(outputs)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    def loader(self, seed, opts):
        if isinstance(self.trainer.accelerator, lightning_graphcore.IPUAccelerator):
            return poptorch.DataLoader(opts, data(seed), batch_size=B)
        return torch.utils.data.DataLoader(data(seed), batch_size=B)

    def train_dataloader(self):
        return self.loader(1, self.trainer.strategy.training_opts)

    def val_dataloader(self):
        return self.loader(2, self.trainer.strategy.inference_opts)

    test_dataloader = predict_dataloader = val_dataloader


def replay(initial, G):
    """The same training in plain PyTorch."""
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    x, y = data(1).tensors
    for _ in range(EPOCHS):
        for start in range(0, ROWS, B * G):
            optimizer.zero_grad()
            losses = [F.cross_entropy(model(x[i:i + B]), y[i:i + B])
                      for i in range(start, start + B * G, B)]
            (sum(losses) / G).backward()
            optimizer.step()
        scheduler.step()
    return model


def main(stages, flavour, out_path):
    G, D = (3, 2) if stages == 2 else (1, 1)
    torch.manual_seed(0)
    model = Net(stages)
    initial = copy.deepcopy(model)
    if flavour == "graphcore":
        lg = lightning_graphcore
        ipu = {"accelerator": lg.IPUAccelerator(), "strategy": lg.IPUStrategy(
            device_iterations=D, precision_plugin=lg.IPUPrecision("32-true"))}
    else:
        ipu = {"accelerator": "ipu", "strategy": pl.strategies.IPUStrategy(device_iterations=D)}
    trainer = pl.Trainer(**ipu, devices=1, max_epochs=EPOCHS, accumulate_grad_batches=G, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    trainer.validate(model)
    trainer.test(model)
    predictions = trainer.predict(model)
    plain = replay(initial, G)
    weights = max((p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
    x, y = data(2).tensors
    with torch.no_grad():
        outputs = [plain(x[i:i + B]) for i in range(0, ROWS, B)]
        losses = [F.cross_entropy(o, y[i:i + B]) for o, i in zip(outputs, range(0, ROWS, B))]
    # a call returns every micro-batch's value (OutputMode.All): D losses, D*B predictions
    moved = min((p - q).abs().max().item() for p, q in zip(model.parameters(), initial.parameters()))
    result = {"weights": weights, "moved": moved, "predict_batches": len(predictions),
              "predict": (torch.cat(predictions) - torch.cat(outputs)).abs().max().item()}
    for fn in ("validate", "test"):
        seen = torch.cat([torch.as_tensor(s).reshape(-1) for s in model.seen[fn]])
        result[fn] = (seen - torch.stack(losses)).abs().max().item()
        result[fn + "_batches"] = len(model.seen[fn])
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
