"""Convert a GGUF checkpoint into a plain HF folder (config.json, safetensors, tokenizer).

Run as `python -m kvflow.workers.convert_gguf GGUF_FILE OUT_DIR`. transformers dequantizes the
GGUF tensors to float32 (it needs the `gguf` and `accelerate` packages). This lives on the
torch side of the project; the frontend calls it in a subprocess so it never imports torch.
"""
import argparse
import os
import shutil
import tempfile


def convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized now: saving the GGUF quantization note would make loaders
    # try to quantize again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.torch_dtype = torch.float32
    # Write next to the target and rename, so an interrupted conversion never leaves a
    # half-written folder that looks complete.
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".convert-")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf_file")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    convert(args.gguf_file, args.out_dir)


if __name__ == "__main__":
    main()
