"""A PopTorch tutorial script, with only its import line changed, runs end to end."""

import os
import pathlib
import subprocess
import sys
import textwrap

from patience import limit

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import poptorch_lite as poptorch

    # The walkthrough of Graphcore's PyTorch basics tutorial, on random data.
    dataset = torch.utils.data.TensorDataset(torch.randn(640, 1, 28, 28),
                                             torch.randint(0, 10, (640,)))

    class ClassificationModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 5, 3)
            self.pool = nn.MaxPool2d(2, 2)
            self.conv2 = nn.Conv2d(5, 12, 5)
            self.norm = nn.GroupNorm(3, 12)
            self.fc1 = nn.Linear(972, 100)
            self.relu = nn.ReLU()
            self.fc2 = nn.Linear(100, 10)
            self.log_softmax = nn.LogSoftmax(dim=1)
            self.loss = nn.NLLLoss()

        def forward(self, x, labels=None):
            x = self.pool(self.relu(self.conv1(x)))
            x = self.norm(self.relu(self.conv2(x)))
            x = torch.flatten(x, start_dim=1)
            x = self.relu(self.fc1(x))
            x = self.log_softmax(self.fc2(x))
            if self.training:
                return x, self.loss(x, labels)
            return x

    model = ClassificationModel()
    model.train()
    initial = model.fc2.weight.detach().clone()

    opts = poptorch.Options()
    opts.deviceIterations(5)
    opts.randomSeed(42)
    opts.useIpuModel(True)
    train_dataloader = poptorch.DataLoader(opts, dataset, batch_size=16, shuffle=True,
                                           drop_last=True, num_workers=2)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    poptorch_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)

    losses = []
    for epoch in range(2):
        for data, labels in train_dataloader:
            output, loss = poptorch_model(data, labels)
            losses.append(float(loss))
    poptorch_model.detachFromDevice()
    torch.save(model.state_dict(), "classifier.pth")

    model = model.eval()
    poptorch_model_inf = poptorch.inferenceModel(model, options=poptorch.Options().deviceIterations(4))
    test_dataloader = poptorch.DataLoader(poptorch.Options().deviceIterations(4), dataset,
                                          batch_size=16, num_workers=2)
    predictions = []
    for data, labels in test_dataloader:
        predictions += poptorch_model_inf(data).argmax(dim=1).tolist()
    poptorch_model_inf.detachFromDevice()
    trained = not torch.equal(initial, torch.load("classifier.pth")["fc2.weight"])
    print(len(losses), len(predictions), trained, all(0 <= p < 10 for p in predictions))
''')


def test_tutorial_script_runs_with_only_the_import_changed(tmp_path):
    script = tmp_path / "walkthrough.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True,
                            text=True, timeout=limit(300), cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    # 640 samples / (16 x 5) = 8 calls per epoch, 2 epochs; 640 / (16 x 4) = 10 calls of 64
    assert result.stdout.split() == ["16", "640", "True", "True"]
    assert (tmp_path / "classifier.pth").exists()
