"""Wrap, call and release 100 models (half by destroy(), half by garbage collection);
print the resident memory before and after, the threads left and the CUDA memory left.
Run by tests/runtime/test_reliability.py in a fresh process."""

import gc
import json
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F

import poptorch_lite as poptorch

from patience import limit  # tests/support/patience.py: this script's folder is on sys.path


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 10)

    def forward(self, x, y=None):
        with poptorch.Block("a", ipu_id=0):
            h = torch.relu(self.a(x))
        with poptorch.Block("b", ipu_id=1):
            out = self.b(h)
            return out if y is None else (out, F.cross_entropy(out, y))


x, y = torch.randn(48, 64), torch.randint(0, 10, (48,))


SCHEDULES = ["grouped", "interleaved", "sequential", "gpipe", "zero_bubble"]


def one(k):
    """Model k trains under the schedules in turn (a zero_bubble run once leaked its wrapper
    through a cycle in autograd's graph)."""
    net = Net()
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(4)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(schedule=SCHEDULES[k % len(SCHEDULES)]))
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(net, opts, optimizer)
    model(x, y)
    inference = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(4))
    inference(x)
    if k % 2:
        model.destroy()
        inference.destroy()


def cuda_bytes():
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for k in range(10):  # warm up torch's own caches first
    one(k)
gc.collect()
start, start_cuda = rss(), cuda_bytes()
for k in range(n):
    one(k)
gc.collect()
deadline = time.monotonic() + limit(60)  # ended threads are seen at once; only a leak waits
while time.monotonic() < deadline and threading.active_count() > 1:
    time.sleep(0.01)
print(json.dumps({"rss_ratio": rss() / start, "cuda_bytes": cuda_bytes() - start_cuda,
                  "threads": [t.name for t in threading.enumerate()
                              if t is not threading.main_thread()]}))
