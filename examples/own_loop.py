"""Your own training loop on commlab's communication engine, launched by plain torchrun.

    torchrun --nproc-per-node 2 examples/own_loop.py --spec examples/topk-ef.yaml
    commlab show <run id it prints>;  commlab trace <run id> -o trace.json

The model, data, sharding and loop are the script's; the spec chooses the compressor, the fusion
schedule, the comm mode (sync, wfbp, dear) and the network, and the run (metrics, per-rank
timelines, status) lands in the runs directory like any other. ``--ddp`` runs the same loop with
torch DDP instead, the reference ``tests/test_own_loop.py`` compares against.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import commlab


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=None, help="job spec (YAML/JSON); default: no compression, wfbp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--runs", default=None, help="runs directory (default $COMMLAB_RUNS or ./runs)")
    ap.add_argument("--ddp", action="store_true", help="torch DDP instead of commlab (the reference)")
    ap.add_argument("--save", default=None, help="save each rank's final parameters to SAVE.rank<r>")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: each rank on GPU local_rank % GPUs (gloo carries "
                    "CUDA tensors, so two ranks may share one GPU)")
    ap.add_argument("--fail-step", type=int, default=None, help="testing: the last rank raises at this step")
    args = ap.parse_args()

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y = load_digits(return_X_y=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32, device=device), torch.tensor(y, device=device)
    torch.manual_seed(0)
    model = Net().to(device)

    def batches():  # each rank its own shard of a shared permutation
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(len(X), generator=g).to(device)
        for step in range(args.steps):
            i = (step * world + rank) * args.batch % (len(X) - args.batch)
            idx = perm[i:i + args.batch]
            yield step, X[idx], y[idx]

    if args.ddp:
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        for _, x, t in batches():
            opt.zero_grad()
            F.cross_entropy(ddp(x), t).backward()
            opt.step()
        del ddp, opt  # DDP's reducer goes before the process group it uses
    else:
        # a factory, not an optimizer: with dear it is built over this rank's parameter shards
        with commlab.wrap(model, lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9), args.spec,
                          runs=args.runs) as comm:
            if rank == 0:
                print(f"run {comm.run_id}  ({comm.run_dir})", flush=True)
            for step, x, t in batches():
                if step == args.fail_step and rank == world - 1:
                    raise RuntimeError(f"injected failure at step {step}")
                loss = F.cross_entropy(model(x), t)
                loss.backward()
                comm.step(loss=loss)  # average (compressed), optimizer step, zero the gradients, log
            comm.sync_params()  # dear: gather the last update before reading the parameters
            with torch.no_grad(), comm.evaluating():  # a method's global parameters (DiLoCo's); else the model's
                out = model.eval()(X)
            acc = (out.argmax(1) == y).float().mean().item()
            comm.log_eval(acc=acc, loss=F.cross_entropy(out, y).item())
            if rank == 0:
                print(f"accuracy {acc:.3f}", flush=True)
    if args.save:
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, f"{args.save}.rank{rank}")
    dist.barrier()  # both ranks are done with every collective before the group is torn down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without C++ static destructors, as commlab's own ranks do (commlab/engine/worker.py): after all work is
    # done and saved, torch's and gloo's sometimes abort at interpreter exit ("terminate called without an active
    # exception"), under torch DDP too, which would fail a finished job. An error in main() still ends it with its
    # traceback and a non-zero status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
