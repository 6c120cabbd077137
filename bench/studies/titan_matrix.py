"""torchtitan's matrix: its own Llama 3 debug model (``bench/studies/titan_user.py``) under every configuration
its parallelisms compose into at W <= 8 here, each trained against one device with the same data by the
harness's torch-parallelization case (loss, every gradient, each AdamW update, a DCP resume), and its
Qwen3-MoE debug model (``parallelize_qwen3``) under expert parallelism with FSDP, TP, PP and activation
checkpointing. Needs torchtitan (the test extra installs it).

    python bench/studies/titan_matrix.py [--only NAME ...] [--md reports/titan_matrix.md]

One gang of 8 ranks runs every configuration (a W=2 case on 2 of them). Context parallelism is torchtitan's own
(``parallelize_llama`` wraps attention, and the step's inputs are cut by its ``prepare_context_parallel_input``
as its trainer does: ``titan_user.LM``), its ring attention run through the CPU flash kernel
(verify/cases/torchpar/ring_cpu.py); not composed with pipelines here (the stages do not go through ``LM``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

USER = ROOT / "bench" / "studies" / "titan_user.py"
STEPS = 2


@dataclass(frozen=True)
class Config:
    """One row: what it composes, the builder and the parallelization (``FILE:NAME``), the mesh."""

    name: str
    model: str
    fn: str
    mesh: str

    @property
    def world(self) -> int:
        w = 1
        for part in self.mesh.split(","):
            w *= int(part.split("=")[1])
        return w


def _u(name: str, fn: str, mesh: str, sp: bool = False) -> Config:
    return Config(name, f"{USER}:{'build_sp' if sp else 'build'}", f"{USER}:{fn}", mesh)


MATRIX: tuple[Config, ...] = (
    _u("FSDP", "par", "dp_shard=2"),
    _u("FSDP (4)", "par", "dp_shard=4"),
    _u("HSDP", "par", "dp_replicate=2,dp_shard=2"),
    _u("TP", "par", "tp=2"),
    _u("TP+SP", "par", "tp=2", sp=True),
    _u("PP GPipe", "par_GPipe", "pp=2"),
    _u("PP 1F1B", "par_1F1B", "pp=2"),
    _u("PP Interleaved1F1B", "par_Interleaved1F1B", "pp=2"),
    _u("PP InterleavedZeroBubble", "par_InterleavedZeroBubble", "pp=2"),
    _u("FSDP x TP+SP", "par", "dp_shard=2,tp=2", sp=True),
    _u("PP x FSDP", "par_1F1B", "pp=2,dp_shard=2"),
    _u("PP x TP+SP", "par_1F1B", "pp=2,tp=2", sp=True),
    _u("HSDP x TP+SP", "par", "dp_replicate=2,dp_shard=2,tp=2", sp=True),
    _u("PP x FSDP x TP+SP", "par_1F1B", "pp=2,dp_shard=2,tp=2", sp=True),
    _u("CP", "par", "cp=2"),
    _u("FSDP x CP", "par", "dp_shard=2,cp=2"),
    _u("CP x TP+SP", "par", "cp=2,tp=2", sp=True),
    _u("FSDP x CP x TP+SP", "par", "dp_shard=2,cp=2,tp=2", sp=True),
    _u("AC + FSDP", "par_ac", "dp_shard=2"),
    _u("AC + FSDP x TP+SP", "par_ac", "dp_shard=2,tp=2", sp=True),
    _u("AC + PP 1F1B", "par_ac_1F1B", "pp=2"),
    _u("AC + HSDP x TP+SP", "par_ac", "dp_replicate=2,dp_shard=2,tp=2", sp=True),
    Config("Qwen3-MoE: FSDP x EP", f"{USER}:build_qwen3", f"{USER}:moe_par", "dp_shard=2"),
    Config("Qwen3-MoE: FSDP x TP x EP", f"{USER}:build_qwen3", f"{USER}:moe_par", "dp_shard=2,tp=2"),
    Config("Qwen3-MoE: PP x FSDP x EP", f"{USER}:build_qwen3", f"{USER}:moe_par_1F1B", "pp=2,dp_shard=2"),
    Config("Qwen3-MoE: AC + FSDP x EP", f"{USER}:build_qwen3", f"{USER}:moe_par_ac", "dp_shard=2"),
)


def run(configs: list[Config], timeout_s: float) -> list[dict]:
    """Every configuration on one gang of the largest world size; a row per configuration."""
    from verify.cases.torchpar.mesh import parse_mesh
    from verify.config import RunConfig
    from verify.rows.torchpar import run_torchpar
    from verify.runner.gang import Gang
    size = max(c.world for c in configs)
    rows = []
    cfg0 = RunConfig(world_sizes=(2,), seeds=(0,), timeout_s=timeout_s)
    with tempfile.TemporaryDirectory() as tmp, Gang(size, (), sorted({c.world for c in configs}),
                                                    pg_timeout_s=max(300.0, 2 * cfg0.limit_s("model", STEPS))) as gang:
        for c in configs:
            t0 = time.perf_counter()
            cfg = RunConfig(world_sizes=(c.world,), seeds=(0,), timeout_s=timeout_s)
            try:
                (row,) = run_torchpar(gang, c.model, c.fn, parse_mesh(c.mesh), cfg, tmp, STEPS, label=c.name)
                status, detail = row.status, " ".join((row.detail or "").split())
                out = f"{row.out_err:.2e} / {row.out_tol:.2e}" if row.out_err is not None else "-"
                grad = f"{row.grad_err:.2e} / {row.grad_tol:.2e}" if row.grad_err is not None else "-"
            except Exception as exc:  # noqa: BLE001  (bad input: its one line)
                status, detail, out, grad = "error", f"{type(exc).__name__}: {exc}", "-", "-"
            rows.append({"config": c.name, "mesh": c.mesh, "W": c.world, "status": status, "loss": out, "grad": grad,
                         "detail": detail, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  {c.name} [{c.mesh}]: {status} {out} {grad} ({rows[-1]['seconds']} s) {detail[:160]}", flush=True)
    return rows


def report(rows: list[dict], command: str, seconds: float) -> str:
    n = sum(r["status"] == "match" for r in rows)
    out = [f"# bench/studies/titan_matrix.py: torchtitan's parallelisms on its own debug models, {n} of {len(rows)} "
           f"match one device", "", f"    {command}", "",
           f"torchtitan 0.3's own `parallelize_llama` / `pipeline_llm` / `parallelize_qwen3`, each configuration trained "
           f"{STEPS} AdamW steps against one device with the same data (loss, every gradient, each update, a DCP "
           f"resume); {seconds / 60:.1f} min in all on this machine (2 cores). Context parallelism: torchtitan's own, its "
           f"ring attention run through the CPU flash kernel; not composed with pipelines here.", "",
           "| configuration | mesh | W | verdict | loss err / tol | grad err / tol | s | detail |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        detail = r["detail"][:200].replace("|", "/") if r["status"] != "match" else ""
        out.append(f"| {r['config']} | `{r['mesh']}` | {r['W']} | {r['status']} | {r['loss']} | {r['grad']} | "
                   f"{r['seconds']} | {detail} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="these configurations (names as in the table)")
    ap.add_argument("--timeout", type=float, default=60.0, help="the harness's case timeout (a model case gets more)")
    ap.add_argument("--md", default=str(ROOT / "reports" / "titan_matrix.md"))
    args = ap.parse_args()
    configs = [c for c in MATRIX if not args.only or c.name in args.only]
    if not configs:
        sys.exit(f"titan_matrix.py: error: no configuration named {args.only}; known: {', '.join(c.name for c in MATRIX)}")
    t0 = time.perf_counter()
    rows = run(configs, args.timeout)
    text = report(rows, "python bench/studies/titan_matrix.py " + " ".join(sys.argv[1:]), time.perf_counter() - t0)
    Path(args.md).write_text(text)
    print(text)
    sys.exit(0 if all(r["status"] == "match" for r in rows) else 1)


if __name__ == "__main__":
    main()
