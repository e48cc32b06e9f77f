"""The Python side of image_loader_vs_torch_dataloader: torch's DataLoader with 2 worker
processes, each sample as diffusers' train_text_to_image.py makes it (PIL open, convert("RGB"),
transforms.Resize(512, bilinear), CenterCrop(512), ToTensor, Normalize([0.5], [0.5])), batches of 4.
Usage: python_image_loader.py DIR; writes 48 JPEGs of assorted sizes around 512 px into DIR when
they are not there, and prints {"seconds_per_step": ...} for one pass over them."""
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch

torch.set_num_threads(1)


class Images(torch.utils.data.Dataset):
    def __init__(self, files):
        from torchvision import transforms
        self.files = files
        self.t = transforms.Compose([
            transforms.Resize(512, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(512), transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image
        with Image.open(self.files[i]) as im:
            return self.t(im.convert("RGB"))


def main():
    folder = pathlib.Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(folder.glob("*.jpg"))
    if len(files) < 48:
        from PIL import Image
        rng = np.random.default_rng(0)
        for i in range(48):
            w, h = int(rng.integers(512, 900)), int(rng.integers(512, 900))
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
            img = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"img{i:03d}.jpg", quality=90)
        files = sorted(folder.glob("*.jpg"))
    loader = torch.utils.data.DataLoader(Images(files), batch_size=4, num_workers=2,
                                         persistent_workers=True)
    for _ in loader:  # workers started, files in the page cache
        pass
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < 2.0:
        for _ in loader:
            pass
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
