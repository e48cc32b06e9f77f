"""Files difftrain writes load in Python: a hypernetwork-shaped .pt through
torch.load(weights_only=True) with its integer keys intact, and embedding PNGs through the web UI's
own decoding of both carriers. Usage: check_cpp_torch_png.py TEST_BINARY GOLDEN_DIR"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import webui_embedding_image as wei  # noqa: E402


def main(binary, golden_dir):
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_TORCH_FILE_OUT=str(out / "hn.pt"), DIFFTRAIN_EMBEDDED_PNG_OUT=str(out))
    subprocess.run([binary, "--gtest_filter=TorchFile.RoundTripsWebUiLayoutsThroughTorchLoad:"
                    "EmbeddedData.WritesFilesTheWebUiReads"], check=True, env=env)

    hn = torch.load(out / "hn.pt", weights_only=True)
    assert list(hn.keys()) == [768, "name", "step", "sd_checkpoint", "use_dropout", "dropout_structure"], hn.keys()
    assert len(hn[768]) == 2 and torch.equal(hn[768][0]["linear.0.weight"], torch.arange(12.0).reshape(3, 4))
    assert hn[768][1]["linear.0.bias"].dtype == torch.bfloat16
    assert hn["sd_checkpoint"] is None and hn["use_dropout"] is True and hn["dropout_structure"] == [0.0, 0.3, 0.0]

    want = torch.tensor(json.loads((pathlib.Path(golden_dir) / "embedding_png.json").read_text())["vec"])
    want = want.reshape(3, 16).float().double()
    for name, text, pixels in [("both.png", True, True), ("image.png", False, True), ("text.png", True, False)]:
        image = Image.open(out / name)
        assert ("sd-ti-embedding" in image.text) == text, name
        if text:
            data = wei.from_b64(image.text["sd-ti-embedding"])
            assert torch.equal(data["string_to_param"]["*"], want), name
        data = wei.extract_image_data(image)
        assert (data is not None) == pixels, name
        if pixels:
            assert data["name"] == "cat-toy" and data["step"] == 1500, name
            assert torch.equal(data["string_to_param"]["*"], want), name
    print("torch.load and the web UI's PNG decoding read difftrain's files")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
