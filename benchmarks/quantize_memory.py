"""Resident memory of an fp32 model loaded with ``from_pretrained``, before and after ``quantize_model``.

Builds ``hal bench --model``'s random model (``--model``, default ``1b``), saves it in fp32 with
``save_pretrained`` into a temporary folder, then in a fresh interpreter: loads it with
``from_pretrained`` (fp32, the file memory-mapped), runs one forward so that every weight is resident as a
user's first call makes it, reads RSS; runs ``quantize_model`` with its defaults (int4, the ``lm_head`` in
int8, the float tensors copied out of the file mapping); reads RSS again, and the peak (VmHWM) of the
quantization. Memory only (no timing), from ``/proc/self/status``; Linux.

Usage: ``python benchmarks/quantize_memory.py [--model 1b] [--json PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SAVE = """
import json, sys, torch, transformers
config = json.loads(sys.argv[2])
kind = config.pop("model_type")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config))
model.save_pretrained(sys.argv[1])
"""

MEASURE = """
import gc, json, sys, torch, transformers
import hal_core.torch as hal_torch

def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

torch.set_num_threads(2)
start = status_mib("VmRSS")
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    model(torch.ones(1, 8, dtype=torch.long))
fp32 = {"rss_mib": status_mib("VmRSS"), "rss_file_mib": status_mib("RssFile"), "peak_mib": status_mib("VmHWM")}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak from here on is the quantization's
report = hal_torch.quantize_model(model)
gc.collect()
with torch.no_grad():
    model(torch.ones(1, 8, dtype=torch.long))
tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
print(json.dumps({
    "rss_at_start_mib": start, "fp32": fp32,
    "quantized": {"rss_mib": status_mib("VmRSS"), "rss_file_mib": status_mib("RssFile"),
                  "quantize_peak_mib": status_mib("VmHWM"),
                  "model_mib": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
                  "quantized_mib": report.quantized_bytes / 2**20, "unmapped_mib": report.unmapped_bytes / 2**20},
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b", help="a hal bench --model built-in size")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    from hal_core.bench._model_spec import resolve_model

    spec = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-c", SAVE, folder, json.dumps(dict(spec.config))], check=True)
        file_mib = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**20
        proc = subprocess.run([sys.executable, "-c", MEASURE, folder], capture_output=True, text=True, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    fp32, quantized = got["fp32"], got["quantized"]
    got.update(model=args.model, checkpoint_mib=file_mib, date=datetime.date.today().isoformat(),
               load_average=os.getloadavg(),
               ratio_rss=quantized["rss_mib"] / fp32["rss_mib"],
               commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
    print(f"{args.model}: fp32 checkpoint {file_mib:.0f} MiB; RSS with the fp32 model {fp32['rss_mib']:.0f} MiB, "
          f"after quantize_model {quantized['rss_mib']:.0f} MiB ({got['ratio_rss']:.2f}x; model "
          f"{quantized['model_mib']:.0f} MiB), quantization peak {quantized['quantize_peak_mib']:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(got, indent=2) + "\n")


if __name__ == "__main__":
    main()
