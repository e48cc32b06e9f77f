"""A safetensors file written by difftrain loads in Python's `safetensors` with the same names,
dtypes, shapes, values and metadata. Usage: check_cpp_safetensors.py TEST_BINARY GOLDEN_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ref_safetensors import tensors  # noqa: E402


def main(binary, golden_dir):
    out = pathlib.Path(tempfile.mkdtemp()) / "from_cpp.safetensors"
    env = dict(os.environ, DIFFTRAIN_SAFETENSORS_OUT=str(out))
    subprocess.run([binary, "--gtest_filter=Safetensors.RoundTripsEveryDtype"], check=True, env=env)
    want = tensors()
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "ss_network_dim": "4"}, f.metadata()
        assert set(f.keys()) == set(want), set(f.keys()) ^ set(want)
        for k in f.keys():
            got = f.get_tensor(k)
            assert got.dtype == want[k].dtype and got.shape == want[k].shape, (k, got.dtype, got.shape)
            # Byte-wise, so float8 and NaN-free comparisons need no arithmetic on those dtypes.
            assert torch.equal(got.reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    print(f"safetensors read difftrain's file: {len(want)} tensors, every byte equal")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
