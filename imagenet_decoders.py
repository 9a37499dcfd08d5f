"""Every way an encoded record of the store (imagenet_store.py) becomes pixels: on the CPU, one image's crop by
simplejpeg at the smallest DCT scale that holds it, resized with PIL's antialiased bilinear filter (cpu_crop; the
worker processes that run it: imagenet_workers.py); on a GPU, a batch of whole JPEGs by nvJPEG through torchvision
(decode_jpeg) or each image's crop box by nvImageCodec (NvImageCodec); which decoder a run uses (jpeg_decoder); which
images nvJPEG's hardware engine takes (nvjpeg_paths); and the one line that names a record no decoder reads
(damaged_record).
"""
import io
import math

import numpy as np
import torch
from PIL import Image

import devices
import distributed as D
from core import DataError, UsageError


# ---------------------------------------------------------------------------------------------
# One image, on the CPU
# ---------------------------------------------------------------------------------------------

def cpu_crop(record, *, box, shape, raw_shape=None):
    """The box (top, left, height, width) of one record resized to shape (height, width) with PIL's antialiased
    bilinear filter: uint8 HWC. A JPEG is decoded by simplejpeg at the smallest DCT scale that keeps the box at least
    as large as the output (as PIL's draft); raw_shape (h, w) marks a raw record of those pixels."""
    top, left, bh, bw = (float(v) for v in box)
    oh, ow = shape
    if raw_shape is not None:
        pixels = np.asarray(record).reshape(*raw_shape, 3)
    else:
        import simplejpeg       # here, not at the top: the GPU decoder and raw stores run without it
        H, W, _, _ = simplejpeg.decode_jpeg_header(record)
        room = min(W // math.ceil(W * ow / bw), H // math.ceil(H * oh / bh))
        f = next(f for f in (8, 4, 2, 1) if f <= max(room, 1))     # libjpeg's eighths in between decode slower
        pixels = simplejpeg.decode_jpeg(record, colorspace="RGB", min_height=-(-H // f), min_width=-(-W // f))
        sy, sx = pixels.shape[0] / H, pixels.shape[1] / W
        top, left, bh, bw = top * sy, left * sx, bh * sy, bw * sx
    im = Image.fromarray(pixels)
    return np.asarray(im.resize((ow, oh), Image.BILINEAR, box=(left, top, left + bw, top + bh)))


def check_cpu_decoder():
    """Raises UsageError (one line) when the CPU decoder's simplejpeg cannot be imported."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        raise UsageError("--decoder cpu decodes JPEGs with simplejpeg, which is not installed: pip install simplejpeg "
                         "(or --decoder gpu on a CUDA GPU)") from None


def pil_decodes(record):
    """Whether PIL decodes the encoded image record (at its smallest DCT scale: a check, not a use)."""
    try:
        with Image.open(io.BytesIO(np.asarray(record).tobytes())) as im:
            im.draft("RGB", (1, 1))
            im.load()
        return True
    except Exception:       # whatever PIL raises, the record is not an image it reads
        return False


# ---------------------------------------------------------------------------------------------
# A batch decoded on the GPU: which decoder, nvJPEG (torchvision) and nvImageCodec, and which images nvJPEG's
# hardware engine takes
# ---------------------------------------------------------------------------------------------

DECODERS = ("auto", "cpu", "gpu", "nvimgcodec")
GPU_DECODERS = {"gpu": "nvJPEG", "nvimgcodec": "nvImageCodec"}     # batched on the device: what each runs


def jpeg_decoder(device, choice="auto"):
    """Where JPEG records are decoded: "gpu" (nvJPEG, batched, through torchvision) on a CUDA device, else "cpu"
    (simplejpeg in worker processes); "nvimgcodec" (NVIDIA's nvImageCodec, batched) when asked. A choice not in
    DECODERS, a GPU decoder on another device, or nvImageCodec not installed is a ValueError of one line."""
    if choice not in DECODERS:
        raise ValueError(f"--decoder {choice}: choose from {', '.join(DECODERS)}")
    cuda = torch.device(device).type == "cuda"
    if choice in GPU_DECODERS and not cuda:
        raise ValueError(f"--decoder {choice} needs a CUDA device ({GPU_DECODERS[choice]}); this run is on {device}")
    if choice == "nvimgcodec":
        nvimgcodec_module()
    return ("gpu" if cuda else "cpu") if choice == "auto" else choice


def nvimgcodec_package():
    """The pip package of nvImageCodec built for torch's CUDA: nvidia-nvimgcodec-cu12 or nvidia-nvimgcodec-cu13."""
    return f"nvidia-nvimgcodec-cu{(torch.version.cuda or '12').split('.')[0]}"


def nvimgcodec_module():
    """nvImageCodec's Python module, imported on first use (an optional install); a UsageError of one line naming
    its pip package when it is missing."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        raise UsageError(f"--decoder nvimgcodec needs nvImageCodec: pip install {nvimgcodec_package()}") from None
    return nvimgcodec


def decodes_crops(decoder):
    """Whether the decoder decodes just each image's crop box (nvImageCodec's region-of-interest decode) rather
    than the whole image."""
    return decoder == "nvimgcodec"


def decode_jpeg(records, device, *, decoder="gpu", boxes=None):
    """A list of encoded JPEGs (uint8 numpy arrays) -> a list of CHW uint8 RGB images on device, in their order,
    decoded in one batched call on the current stream: "gpu": nvJPEG through torchvision (no extra install;
    docs/perf-notes.md), whole images; "nvimgcodec": nvImageCodec, each image just its box of boxes (n, 4)."""
    if decoder == "nvimgcodec":
        return nvimgcodec_decoder(device).decode(records, boxes)
    import warnings
    from torchvision.io import ImageReadMode, decode_jpeg as decode
    with warnings.catch_warnings():     # deprecated in torchvision 0.29 for TorchCodec's, which needs torch >= 2.11
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode([torch.from_numpy(np.asarray(r)) for r in records], mode=ImageReadMode.RGB, device=device)


NVIMGCODEC = {}     # device index -> its NvImageCodec, made on first use


def nvimgcodec_decoder(device):
    """This process's NvImageCodec for the CUDA device (one a GPU, kept: making one sets up nvJPEG's state)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in NVIMGCODEC:
        NVIMGCODEC[index] = NvImageCodec(index)
    return NVIMGCODEC[index]


class NvImageCodec:
    """nvImageCodec's batched decoder on one GPU. Its images live in nvImageCodec's memory, not torch's caching
    allocator, so record_stream cannot keep them: each batch is held until the next call, by which time the caller
    has drained the stream that read it (gpu_images drains the side stream before every decode)."""

    def __init__(self, index):
        self.nv, self.index, self.held = nvimgcodec_module(), index, []
        self.decoder = self.nv.Decoder(device_id=index)
        self.params = self.nv.DecodeParams(color_spec=self.nv.ColorSpec.RGB)

    def source(self, record, box):
        """What to decode of one record: the whole code stream, or its region (top, left, height, width)."""
        stream = self.nv.CodeStream(np.ascontiguousarray(record))
        if box is None:
            return stream
        top, left, h, w = (int(v) for v in box)
        region = self.nv.Region(top, left, top + h, left + w)
        if hasattr(stream, "get_sub_code_stream"):           # newer versions; older ones take a DecodeSource
            return stream.get_sub_code_stream(region=region)
        return self.nv.DecodeSource(stream, region)

    def decode(self, records, boxes=None):
        """The records (each just its box when boxes are given) as CHW uint8 tensors on this GPU, decoded on the
        current stream, which the tensors are ordered after (DLPack's stream handshake)."""
        boxes = [None] * len(records) if boxes is None else boxes
        stream = torch.cuda.current_stream(self.index)
        images = self.decoder.decode([self.source(r, b) for r, b in zip(records, boxes)], params=self.params,
                                     cuda_stream=stream.cuda_stream)
        failed = [i for i, image in enumerate(images) if image is None]
        if failed:
            raise RuntimeError(f"nvImageCodec could not decode {len(failed)} of the batch's {len(images)} JPEGs "
                               f"(the first at position {failed[0]})")
        self.held = images
        return [torch.from_dlpack(image).permute(2, 0, 1) for image in images]


NVJPEG_BACKEND_HARDWARE = 3     # nvjpegBackend_t, nvjpeg.h


def nvjpeg_hardware(device):
    """Whether nvJPEG has its hardware decoder on this CUDA device (A100, H100, ...), as torchvision's batched decode
    asks it: a handle of NVJPEG_BACKEND_HARDWARE made by the nvJPEG library torchvision loaded (ctypes, ours: torch
    and torchvision do not tell); None where that library cannot be found or asked."""
    index = torch.device(device).index
    if index not in NVJPEG_HARDWARE:
        NVJPEG_HARDWARE[index] = ask_nvjpeg_hardware(device)
    return NVJPEG_HARDWARE[index]


NVJPEG_HARDWARE = {}        # device index -> nvjpeg_hardware's answer, asked once


def ask_nvjpeg_hardware(device):
    import ctypes
    import torchvision.io.image  # noqa: F401  (loads torchvision's image library, and with it nvJPEG's)
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libnvjpeg" in line), None)
        if path is None:
            return None
        lib, handle = ctypes.CDLL(path), ctypes.c_void_p()
        with torch.cuda.device(torch.device(device)):
            status = lib.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
        if status == 0:
            lib.nvjpegDestroy(handle)
        return status == 0
    except (OSError, AttributeError):
        return None


HARDWARE_SAMPLING = {(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2)}     # luma's factors over chroma's (1, 1)


def jpeg_frame(record):
    """(the SOFn marker, sample precision, each component's (horizontal, vertical) sampling factors) of an encoded
    JPEG, from its markers; None where its frame header cannot be found."""
    i = 2
    while i + 10 <= len(record):
        if record[i] != 0xFF:
            return None
        marker = int(record[i + 1])
        if marker == 0xFF:                  # a fill byte
            i += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            n = int(record[i + 9])
            factors = [(int(record[i + 11 + 3 * k]) >> 4, int(record[i + 11 + 3 * k]) & 15) for k in range(n)
                       if i + 11 + 3 * k < len(record)]
            return marker, int(record[i + 4]), factors
        i += 2 + (int(record[i + 2]) << 8 | int(record[i + 3]))
    return None


def hardware_decodable(record):
    """Whether nvJPEG's hardware decoder takes this JPEG (as its nvjpegDecodeBatchedSupported does, to our reading
    of nvJPEG's documentation): baseline Huffman, 8 bits, grey or three components with full-resolution chroma
    beside luma at one of HARDWARE_SAMPLING. Progressive JPEGs, among others, go to its software path."""
    frame = jpeg_frame(record)
    if frame is None or frame[0] != 0xC0 or frame[1] != 8 or len(frame[2]) not in (1, 3):
        return False
    return len(frame[2]) == 1 or (frame[2][0] in HARDWARE_SAMPLING and frame[2][1] == frame[2][2] == (1, 1))


def nvjpeg_paths(records, device):
    """How many of the encoded JPEGs torchvision's batched nvJPEG decode sends down each path on device: "hardware"
    (its hardware decoder: hardware_decodable records where nvjpeg_hardware), "software" (the rest, decoded one by
    one), or "unknown" for the hardware-decodable ones where nvjpeg_hardware cannot tell."""
    hardware = nvjpeg_hardware(device)
    counts = {"hardware": 0, "software": 0, "unknown": 0}
    for r in records:
        eligible = hardware is not False and hardware_decodable(r)
        counts["software" if not eligible else "hardware" if hardware else "unknown"] += 1
    return counts


def gpu_images(records, side, counts, *, device, decoder="gpu", boxes=None):
    """In the reader thread: the encoded records decoded on the side stream (decode_jpeg, by `decoder`, each
    just its box of boxes where given), added to the Counter counts: by nvJPEG's path each took
    (nvjpeg_paths), or under the decoder's name."""
    # nvJPEG's own stream waits on nothing (torchvision pull request 9606): side's queued reads must end first
    devices.drain(side)
    counts.update(nvjpeg_paths(records, device) if decoder == "gpu" else {decoder: len(records)})
    with devices.on_stream(side):
        return decode_jpeg(records, device, decoder=decoder, boxes=boxes)


def gpu_row_images(data, split, rows, side, *, device, boxes=None):
    """gpu_images of the records of a store split's rows by data.decoder; where the decoder fails on a record that
    PIL cannot decode either, a DataError naming that record (damaged_record), else the decoder's error."""
    records = data.store.train if split == "train" else data.store.val
    encoded = [records.record(r) for r in rows]
    try:
        return gpu_images(encoded, side, data.decoded, device=device, decoder=data.decoder, boxes=boxes)
    except RuntimeError as e:
        bad = next((r for r, record in zip(rows, encoded) if not pil_decodes(record)), None)
        if bad is None:
            raise
        raise DataError(damaged_record(data.store, split, bad, e)) from None


# ---------------------------------------------------------------------------------------------
# What the decoders did: a record they refused, and how an epoch's images were decoded
# ---------------------------------------------------------------------------------------------

def damaged_record(store, split, row, error):
    """The line that names a record of a store's split (row `row` of its index) that its decoder refused."""
    records = store.train if split == "train" else store.val
    label = int(records.rows["label"][row])
    return (f"{records.data.filename}: record {row} (a {split} image of class {store.index['classes'][label]}) "
            f"cannot be decoded ({type(error).__name__}: {D.first_sentence(error)}); the store is damaged: prepare it "
            "again")


def decoded_by_text(counts):
    """How an epoch's images were decoded, in a table's column (counts: the change in RankData.decoded over it): "cpu",
    "nvimgcodec", nvJPEG's "<hardware>h/<software>s" ("?" for hardware-decodable images where nvjpeg_hardware cannot
    tell), or "-" (a raw store's, nothing to decode)."""
    for name in ("cpu", "nvimgcodec"):
        if counts.get(name):
            return name
    if not any(counts.get(k) for k in ("hardware", "software", "unknown")):
        return "-"
    hardware = f"{counts['unknown']}?" if counts.get("unknown") else f"{counts.get('hardware', 0)}h"
    return f"{hardware}/{counts.get('software', 0)}s"
