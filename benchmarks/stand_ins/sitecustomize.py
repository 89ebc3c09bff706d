"""For ``benchmarks/apps.py``: with ``APPS_GENERATED_CIFAR10=N`` set, torchvision's CIFAR10 is
N generated 32x32 images of the 10 classes (N // 2 for ``train=False``), with no download,
for programs whose tests read CIFAR-10 (this machine has no internet). Nothing otherwise."""

import os

if os.environ.get("APPS_GENERATED_CIFAR10"):
    import numpy as np
    import torchvision
    from PIL import Image

    class GeneratedCIFAR10(torchvision.datasets.VisionDataset):
        """CIFAR10's interface: ``(PIL image, class)`` items, ``data`` and ``targets``."""

        classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck"]

        def __init__(self, root, train=True, transform=None, target_transform=None,
                     download=False):
            super().__init__(root, transform=transform, target_transform=target_transform)
            n = int(os.environ["APPS_GENERATED_CIFAR10"]) // (1 if train else 2)
            rng = np.random.default_rng(0 if train else 1)
            self.train = train
            self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            self.targets = rng.integers(0, 10, n).tolist()

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            image, target = Image.fromarray(self.data[index]), self.targets[index]
            if self.transform is not None:
                image = self.transform(image)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return image, target

    torchvision.datasets.CIFAR10 = GeneratedCIFAR10
