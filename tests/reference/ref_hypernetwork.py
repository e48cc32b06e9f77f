"""The web UI's HypernetworkModule and Hypernetwork.save layout (seed 000), restated in plain PyTorch.
Each case builds a module pair, saves its state dict, an input and the outputs in eval mode
(multiplier applied) and train mode (without dropout, so deterministic); one case is saved as a
whole web UI .pt file (integer width keys, settings) for the C++ loader."""
import json

import torch
from safetensors.torch import save_file

ACTIVATIONS = {"linear": torch.nn.Identity, "relu": torch.nn.ReLU, "leakyrelu": torch.nn.LeakyReLU,
               "elu": torch.nn.ELU, "swish": torch.nn.Hardswish, "tanh": torch.nn.Tanh,
               "sigmoid": torch.nn.Sigmoid, "gelu": torch.nn.GELU, "mish": torch.nn.Mish}


def parse_dropout_structure(layer_structure, use_dropout, last_layer_dropout):
    if layer_structure is None:
        layer_structure = [1, 2, 1]
    if not use_dropout:
        return [0] * len(layer_structure)
    dropout_values = [0]
    dropout_values.extend([0.3] * (len(layer_structure) - 3))
    dropout_values.append(0.3 if last_layer_dropout else 0)
    dropout_values.append(0)
    return dropout_values


class HypernetworkModule(torch.nn.Module):
    def __init__(self, dim, layer_structure, activation_func, add_layer_norm, activate_output, dropout_structure):
        super().__init__()
        self.multiplier = 1.0
        linears = []
        for i in range(len(layer_structure) - 1):
            linears.append(torch.nn.Linear(int(dim * layer_structure[i]), int(dim * layer_structure[i + 1])))
            if activation_func == "linear" or activation_func is None or (i >= len(layer_structure) - 2 and not activate_output):
                pass
            else:
                linears.append(ACTIVATIONS[activation_func]())
            if add_layer_norm:
                linears.append(torch.nn.LayerNorm(int(dim * layer_structure[i + 1])))
            if dropout_structure is not None and dropout_structure[i + 1] > 0:
                linears.append(torch.nn.Dropout(p=dropout_structure[i + 1]))
        self.linear = torch.nn.Sequential(*linears)

    def forward(self, x):
        return x + self.linear(x) * (self.multiplier if not self.training else 1)


CASES = {
    "relu": dict(dim=8, layer_structure=[1, 2, 1], activation_func="relu", add_layer_norm=False,
                 activate_output=False, use_dropout=False, last_layer_dropout=False),
    "deep": dict(dim=6, layer_structure=[1, 1.5, 2, 1], activation_func="leakyrelu", add_layer_norm=True,
                 activate_output=True, use_dropout=True, last_layer_dropout=True),
    "swish": dict(dim=4, layer_structure=[1, 2, 2, 1], activation_func="swish", add_layer_norm=False,
                  activate_output=False, use_dropout=True, last_layer_dropout=False),
}


def generate(out):
    g = torch.Generator().manual_seed(5)
    for name, c in CASES.items():
        ds = parse_dropout_structure(c["layer_structure"], c["use_dropout"], c["last_layer_dropout"])
        m = HypernetworkModule(c["dim"], c["layer_structure"], c["activation_func"], c["add_layer_norm"],
                               c["activate_output"], ds)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        x = torch.randn(2, 3, c["dim"], generator=g)
        m.eval()
        m.multiplier = 0.7
        y_eval = m(x)
        m.train()
        for mod in m.linear:  # train mode without dropout, to be deterministic
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        y_train = m(x)
        t = {f"w.{k}": v for k, v in m.state_dict().items()}
        t.update({"in.x": x, "out.eval": y_eval, "out.train": y_train})
        meta = dict(c, dropout_structure=ds)
        save_file({k: v.detach().contiguous() for k, v in t.items()}, str(out / f"hypernetwork_{name}.safetensors"),
                  metadata={"case": json.dumps(meta)})
    # A whole web UI file: widths 8 and 12, the "deep" settings.
    c = CASES["deep"]
    ds = parse_dropout_structure(c["layer_structure"], True, True)
    sd = {}
    for size in (8, 12):
        pair = []
        for _ in range(2):
            m = HypernetworkModule(size, c["layer_structure"], c["activation_func"], True, True, ds)
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            pair.append(m.state_dict())
        sd[size] = tuple(pair)
    sd.update({"step": 321, "name": "webui-hn", "layer_structure": c["layer_structure"],
               "activation_func": "leakyrelu", "is_layer_norm": True, "weight_initialization": "XavierNormal",
               "sd_checkpoint": "a9263745", "sd_checkpoint_name": "v1-5-pruned", "activate_output": True,
               "use_dropout": True, "dropout_structure": ds, "last_layer_dropout": True, "optional_info": "made in Python"})
    torch.save(sd, str(out / "hypernetwork_webui.pt"))
    ctx = torch.randn(2, 5, 12, generator=g)
    m = HypernetworkModule(12, c["layer_structure"], "leakyrelu", True, True, ds)
    m.load_state_dict(sd[12][1])
    m.eval()
    save_file({"in.context": ctx, "out.v": m(ctx).detach()}, str(out / "hypernetwork_webui_check.safetensors"))
