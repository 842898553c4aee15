"""A small synthetic image + text dataset (seeded), for the vision-language model
(:mod:`paratron.models.vlm`) and its pipeline tests and benchmark.

Format of one sample (:class:`ImageTextBatch` holds a batch of them):

* ``images``: float32 ``[b, channels, image_size, image_size]``, values in ``[0, 1)``: a random
  background plus one bright square of a random colour at a random place;
* ``text``: int64 ``[b, text_length]`` token ids in ``[0, vocab_size)``: a caption whose tokens
  encode the square's colour bucket and position (so the text depends on the image), then
  seeded noise tokens.

Sample ``i`` of seed ``s`` is drawn from its own generator (``s * 1_000_003 + i``), so any slice of
the dataset is the same on every rank and in one process. :func:`patchify` cuts images into the
encoder's input ``[b, num_patches, channels * patch**2]`` (row-major patches, channels last within
a patch, as ViT's linear patch embedding reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageTextBatch:
    images: torch.Tensor  # [b, c, H, W] float32
    text: torch.Tensor    # [b, t] int64


def synthetic_image_text(indices: range | list[int], *, seed: int, image_size: int = 8, channels: int = 3,
                         text_length: int = 8, vocab_size: int = 64) -> ImageTextBatch:
    """The samples ``indices`` of the seeded dataset (see the module docstring for the format).

    Raises:
        ValueError: ``vocab_size < 16``, ``image_size < 2`` or ``text_length < 3``.
    """
    if vocab_size < 16 or image_size < 2 or text_length < 3:
        raise ValueError(f"synthetic_image_text: vocab_size={vocab_size} must be >= 16, image_size={image_size} >= 2 "
                         f"and text_length={text_length} >= 3")
    images, texts = [], []
    for i in indices:
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(i))
        img = 0.3 * torch.rand(channels, image_size, image_size, generator=g)
        side = max(1, image_size // 4)
        y, x = (int(v) for v in torch.randint(0, image_size - side + 1, (2,), generator=g))
        colour = torch.rand(channels, generator=g)
        img[:, y:y + side, x:x + side] = 0.5 + 0.5 * colour[:, None, None]
        bucket = int((colour * 3.999).long() @ torch.tensor([1, 4, 16][:channels])) % (vocab_size - 8)
        caption = torch.tensor([1, 8 + bucket, 2 + (y * 3) // image_size, 5 + (x * 3) // image_size])
        noise = torch.randint(0, vocab_size, (max(0, text_length - len(caption)),), generator=g)
        images.append(img)
        texts.append(torch.cat([caption, noise])[:text_length])
    return ImageTextBatch(torch.stack(images), torch.stack(texts))


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``[b, c, H, W]`` -> ``[b, (H/patch)*(W/patch), patch*patch*c]``.

    Raises:
        ValueError: ``H`` or ``W`` not a multiple of ``patch``.
    """
    b, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)
