"""PyTorch AMP on the same device, same models, batch and data, same timing.

Runs only where ``torch`` imports (never a required dependency). Each
precision gets its own model (channels-last) and SGD optimizer (Nesterov
momentum 0.9, weight decay 5e-4, as the JAX recipe), and a train step that,
like the JAX step, gathers its batch from a device-resident uint8 data set,
crops (4-pixel padding) and flips it, and normalizes it on the device:

* ``fp32``: float32 with TF32 off (``torch.backends.*.allow_tf32 = False``);
* ``tf32``: float32 with TF32 on;
* ``mixed``: on CUDA, ``torch.autocast`` float16 with ``torch.amp.GradScaler``;
  on CPU (where float16 autocast is not the recipe) bfloat16 autocast;
* ``mixed_bf16``: bfloat16 autocast.

PyTorch runs eagerly (no ``torch.compile``), as most AMP users run it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from experiments.benchmark import timing

# The precisions above, each with its PyTorch recipe; the torch section runs these of --precisions.
PRECISIONS = ("fp32", "tf32", "mixed", "mixed_bf16")
_UNIFORM_MEAN, _UNIFORM_STD = 0.5, 0.2898  # of uniform uint8 pixels, as experiments.data's synthetic set


def torch_available() -> bool:
    """Whether PyTorch can be imported here."""
    return importlib.util.find_spec("torch") is not None


class TorchStep:
    """One model x precision: a train step and an eval step, each a no-argument callable."""

    def __init__(self, model_name: str, precision: str, batch_size: int, images, labels, device: str):
        import torch  # pylint: disable=g-import-not-at-top

        from experiments import torch_reference  # pylint: disable=g-import-not-at-top

        self.torch, self.precision, self.batch_size = torch, precision, batch_size
        self.images, self.labels, self.device = images, labels, device
        self.model = torch_reference.create_model(model_name).to(device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        half = None
        if precision == "mixed":
            half = torch.float16 if device == "cuda" else torch.bfloat16
        elif precision == "mixed_bf16":
            half = torch.bfloat16
        elif precision not in ("fp32", "tf32"):
            raise ValueError(
                f"No PyTorch recipe for precision {precision!r}; choose fp32, tf32, mixed, mixed_bf16."
            )
        self.autocast_dtype = half
        self.scaler = torch.amp.GradScaler(device) if half == torch.float16 else None
        self.generator = torch.Generator(device=device).manual_seed(0)
        self.offsets = torch.arange(32, device=device)

    def _set_tf32(self) -> None:
        # Global switches: set before every step, since variants interleave.
        allow = self.precision != "fp32"
        self.torch.backends.cuda.matmul.allow_tf32 = allow
        self.torch.backends.cudnn.allow_tf32 = allow

    def _batch(self):
        torch = self.torch
        count = self.images.shape[0]
        indices = torch.randint(0, count, (self.batch_size,), device=self.device, generator=self.generator)
        images = self.images[indices]  # uint8 [B, 32, 32, 3]
        padded = torch.nn.functional.pad(images, (0, 0, 4, 4, 4, 4))
        dy, dx = torch.randint(0, 9, (2, self.batch_size, 1), device=self.device, generator=self.generator)
        rows, cols = (dy + self.offsets)[:, :, None], (dx + self.offsets)[:, None, :]
        batch = torch.arange(self.batch_size, device=self.device)[:, None, None]
        cropped = padded[batch, rows, cols]
        flip = torch.rand(self.batch_size, device=self.device, generator=self.generator) < 0.5
        cropped = torch.where(flip[:, None, None, None], cropped.flip(2), cropped)
        pixels = (cropped.float() / 255.0 - _UNIFORM_MEAN) / _UNIFORM_STD
        inputs = pixels.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        return inputs, self.labels[indices]

    def _autocast(self):
        return self.torch.autocast(
            self.device,
            dtype=self.autocast_dtype or self.torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def train_step(self) -> Any:
        self._set_tf32()
        inputs, labels = self._batch()
        with self._autocast():
            loss = self.torch.nn.functional.cross_entropy(self.model(inputs).float(), labels)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss

    def eval_step(self) -> Any:
        self._set_tf32()
        self.model.eval()
        with self.torch.no_grad(), self._autocast():
            inputs = (self.images[: self.batch_size].float() / 255.0 - _UNIFORM_MEAN) / _UNIFORM_STD
            inputs = inputs.permute(0, 3, 1, 2).contiguous(memory_format=self.torch.channels_last)
            logits = self.model(inputs)
        self.model.train()
        return logits


def measure(
    model_name: str, precisions: list[str], batch_size: int, rounds: int, steps: int, num_train: int
) -> dict[str, dict[str, Any]]:
    """Train and eval images/s of each precision, timed interleaved."""
    import torch  # pylint: disable=g-import-not-at-top

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (num_train, 32, 32, 3), dtype=np.uint8)).to(device)
    labels = torch.from_numpy(rng.integers(0, 10, (num_train,), dtype=np.int64)).to(device)
    steps_by_precision = {p: TorchStep(model_name, p, batch_size, images, labels, device) for p in precisions}

    def synchronize(_):
        if device == "cuda":
            torch.cuda.synchronize()

    train_s = timing.interleaved_medians(
        {p: step.train_step for p, step in steps_by_precision.items()}, rounds, steps, synchronize=synchronize
    )
    eval_s = timing.interleaved_medians(
        {p: step.eval_step for p, step in steps_by_precision.items()}, rounds, steps, synchronize=synchronize
    )
    return {
        precision: {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch_version": torch.__version__,
            "autocast_dtype": str(step.autocast_dtype).removeprefix("torch.")
            if step.autocast_dtype
            else None,
            "grad_scaler": step.scaler is not None,
            "train_images_per_s": batch_size / train_s[precision],
            "eval_images_per_s": batch_size / eval_s[precision],
        }
        for precision, step in steps_by_precision.items()
    }
