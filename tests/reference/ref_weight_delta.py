"""Golden values for LoHa and LoKr (adapters/weight_delta.hpp): PEFT's LoHaConfig / LoKrConfig
adapters (random initialisation, so every factor is non-zero) on a Linear, a 3×3 and a 1×1
convolution, over a sweep of ranks, alphas, LoKr factors and decompose_both — the adapted layers'
outputs, PEFT's ΔW, and lycoris-lora's ΔW from the same tensors (its functional API, the maths
its files are applied with: gamma = alpha for LoKr, alpha / rank for LoHa).

Writes weight_delta.safetensors: per case `<case>.<module>.{weight,bias}`, the adapter tensors under
PEFT's names `<case>.<module>.hada_w1_a` / `.lokr_w1` ..., `<case>.<module>.x`, `.y` (the adapted
output), `.delta` (PEFT) and `.lycoris_delta`; weight_delta.json: the cases' settings.
"""
import json

import torch
from safetensors.torch import save_file


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(24, 36)
        self.conv = torch.nn.Conv2d(8, 12, 3, padding=1)
        self.point = torch.nn.Conv2d(12, 16, 1)


INPUTS = {"lin": (5, 24), "conv": (2, 8, 6, 6), "point": (2, 12, 5, 5)}

CASES = []
for rank, alpha in ((4, 4.0), (4, 8.0), (2, 1.0)):
    CASES.append({"name": f"loha_r{rank}_a{alpha}", "kind": "loha", "rank": rank, "alpha": alpha,
                  "factor": -1, "decompose_both": False})
for rank, alpha, factor, both in ((4, 4.0, -1, False), (4, 8.0, -1, True), (2, 1.0, -1, False),
                                  (16, 4.0, -1, False), (4, 2.0, 4, False), (1, 3.0, 2, True)):
    CASES.append({"name": f"lokr_r{rank}_a{alpha}_f{factor}_b{int(both)}", "kind": "lokr",
                  "rank": rank, "alpha": alpha, "factor": factor, "decompose_both": both})


def generate(out_dir):
    from peft import LoHaConfig, LoKrConfig, get_peft_model
    import lycoris.functional.loha as lyco_loha
    import lycoris.functional.lokr as lyco_lokr
    tensors, meta = {}, []
    for i, case in enumerate(CASES):
        torch.manual_seed(100 + i)
        net = Net()
        base = {n: p.detach().clone() for n, p in net.named_parameters()}
        if case["kind"] == "loha":
            config = LoHaConfig(r=case["rank"], alpha=case["alpha"], init_weights=False,
                                target_modules=["lin", "conv", "point"])
        else:
            config = LoKrConfig(r=case["rank"], alpha=case["alpha"], init_weights=False,
                                decompose_factor=case["factor"],
                                decompose_both=case["decompose_both"],
                                target_modules=["lin", "conv", "point"])
        model = get_peft_model(net, config)
        name = case["name"]
        for module in ("lin", "conv", "point"):
            layer = getattr(model.base_model.model, module)
            tensors[f"{name}.{module}.weight"] = base[f"{module}.weight"]
            tensors[f"{name}.{module}.bias"] = base[f"{module}.bias"]
            params = {}
            for pname in layer.adapter_layer_names:
                d = getattr(layer, pname)
                if "default" in d:
                    params[pname] = d["default"].detach().clone()
                    tensors[f"{name}.{module}.{pname}"] = params[pname]
            x = torch.randn(*INPUTS[module])
            with torch.no_grad():
                tensors[f"{name}.{module}.x"] = x
                tensors[f"{name}.{module}.y"] = layer(x)
                tensors[f"{name}.{module}.delta"] = layer.get_delta_weight("default")
                shape = base[f"{module}.weight"].shape
                if case["kind"] == "loha":
                    lyco = lyco_loha.diff_weight(params["hada_w1_b"], params["hada_w1_a"],
                                                 params["hada_w2_b"], params["hada_w2_a"], None,
                                                 None, gamma=case["alpha"] / case["rank"])
                else:
                    w2 = params.get("lokr_w2")
                    lyco = lyco_lokr.diff_weight(params.get("lokr_w1"), params.get("lokr_w1_a"),
                                                 params.get("lokr_w1_b"), w2,
                                                 params.get("lokr_w2_a"), params.get("lokr_w2_b"),
                                                 None, gamma=case["alpha"])
                tensors[f"{name}.{module}.lycoris_delta"] = lyco.reshape(shape).contiguous()
        meta.append(case)
    save_file(tensors, str(out_dir / "weight_delta.safetensors"))
    (out_dir / "weight_delta.json").write_text(json.dumps({"cases": meta}, indent=1))


if __name__ == "__main__":
    import pathlib
    import sys
    generate(pathlib.Path(sys.argv[1]))
