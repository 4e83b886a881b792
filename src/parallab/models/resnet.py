"""The ResNet-18 fine-tuning recipe: torchvision's ResNet-18, its fc replaced for model.num_classes.

model.weights is a state_dict file (torchvision's keys; any fc is dropped) or a torchvision
weights name (IMAGENET1K_V1, DEFAULT), fetched into torch's hub cache by the controlling
process; offline, the check names the file to put there. model.freeze_backbone trains the
new head only: the backbone's parameters need no gradient and its BatchNorm statistics stay.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallab.models.base import Model, fits_classes


def weights_file(weights: str, fetch: bool = False) -> Path:
    """The file model.weights names; a torchvision name means its file in the hub cache,
    downloaded first if `fetch`. Raises ValueError (one line) when there is none."""
    path = Path(weights).expanduser()
    if path.suffix in (".pt", ".pth") or "/" in weights:
        if not path.is_file():
            raise ValueError(f"model.weights={weights}: no such file: give a resnet18 "
                             "state_dict file or a torchvision weights name (IMAGENET1K_V1)")
        return path
    from torchvision.models import ResNet18_Weights

    try:
        entry = ResNet18_Weights[weights.removeprefix("ResNet18_Weights.")]
    except KeyError:
        names = ", ".join(w.name for w in ResNet18_Weights)
        raise ValueError(f"model.weights={weights} is neither a file (.pt/.pth) nor one of "
                         f"torchvision's resnet18 weights ({names}, DEFAULT)") from None
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(entry.url).name
    if not cached.is_file() and fetch:
        try:
            torch.hub.load_state_dict_from_url(entry.url, progress=False, check_hash=True)
        except Exception as error:  # offline, mirror down: the fix is the file itself
            reason = (str(error).splitlines() or [""])[0]
            raise ValueError(f"model.weights={weights} needs {cached}, which could not be "
                             f"downloaded from {entry.url} ({type(error).__name__}: {reason}):"
                             f" put that file there, or give model.weights=PATH") from None
    if not cached.is_file():
        raise ValueError(f"model.weights={weights} needs {cached}: put it there, or give "
                         "model.weights=PATH")
    return cached


def load_backbone(net: nn.Module, weights: str, fetch: bool = False) -> None:
    """model.weights into torchvision's resnet18 `net`, all but fc; ValueError (one line)
    when the file is not such a state_dict."""
    state = torch.load(weights_file(weights, fetch), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"model.weights={weights} holds no state_dict")
    try:
        missing, unexpected = net.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith("fc.")}, strict=False)
    except RuntimeError as error:  # a tensor of another shape
        raise ValueError(f"model.weights={weights} does not fit resnet18: "
                         f"{str(error).splitlines()[-1].strip()}") from None
    missing = [k for k in missing if not k.startswith("fc.")]
    if missing or unexpected:
        raise ValueError(f"model.weights={weights} is not a resnet18 state_dict (missing "
                         f"{missing[:2]}, unexpected {unexpected[:2]}): give torchvision's")


class ResNet18(Model):
    def __init__(self, num_classes: int, in_channels: int = 3, weights: str | None = None,
                 freeze_backbone: bool = False):
        super().__init__()
        from torchvision.models import resnet18

        net = resnet18()
        if weights:
            load_backbone(net, weights)
        if in_channels != 3:  # new first conv: pretrained filters averaged
            rgb = net.conv1.weight.detach()
            net.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            with torch.no_grad():
                net.conv1.weight.copy_(rgb.mean(1, keepdim=True).expand_as(net.conv1.weight))
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)  # /4
        self.layer1, self.layer2, self.layer3, self.layer4 = (  # 64, 128, 256, 512 channels
            net.layer1, net.layer2, net.layer3, net.layer4)
        self.head = nn.Sequential(net.avgpool, nn.Flatten(), nn.Linear(512, num_classes))
        self.frozen = freeze_backbone
        for stage in self.stages()[:-1]:
            stage.requires_grad_(not self.frozen)

    def stages(self) -> list[nn.Module]:
        return [self.stem, self.layer1, self.layer2, self.layer3, self.layer4, self.head]

    def train(self, mode: bool = True) -> ResNet18:
        super().train(mode)
        if self.frozen:  # a frozen backbone keeps its BatchNorm statistics too
            for stage in self.stages()[:-1]:
                stage.eval()
        return self

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        shape = list(data.input_shape or [])
        if len(shape) != 3 or getattr(data, "vocab_size", None) is not None:
            return (f"model=resnet18 takes images (C, H, W), but data={data.name} gives "
                    f"{shape}: use data=cifar10, imagefolder, mnist, or synthetic with "
                    "data.shape=[3,32,32]")
        if cfg["in_channels"] is None:
            cfg["in_channels"] = shape[0]
        if cfg["in_channels"] != shape[0]:
            return (f"model.in_channels={cfg['in_channels']} does not fit data={data.name}'s "
                    f"{shape[0]} channels: set model.in_channels={shape[0]} (or null)")
        if cfg["weights"]:
            from torchvision.models import resnet18

            try:  # fetched here, once, before any worker starts; loaded to check it fits
                load_backbone(resnet18(), cfg["weights"], fetch=True)
            except Exception as error:  # noqa: BLE001 - whatever is wrong: one line, a fix
                line = (str(error).splitlines() or [""])[0]
                return line if line.startswith("model.weights=") else (
                    f"model.weights={cfg['weights']} cannot be read ({type(error).__name__}: "
                    f"{line}): give a resnet18 state_dict saved with torch.save")
        return fits_classes(cfg, data)
