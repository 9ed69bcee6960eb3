"""Does splitting a layer's attention into KV-head groups on two streams hide the QKV / o_proj GEMMs under the
attention kernel? (needs CUDA)

    python benchmarks/head_overlap_bench.py [--layers 36] [--groups 1,2,4]

At 256 rows a Qwen3-8B GEMM is compute-bound (~5.7 ms of a decode step) and decode attention is bound by HBM
bandwidth (2-10 ms), yet they run one after the other. With the heads in G groups, group g's QKV GEMM (and
QK-norm/RoPE/KV store) can run while group g-1's attention kernel streams the cache, and group g-1's share of
o_proj (o = sum_g attn_g @ Wo[:, g].T) while group g's attention runs. The bytes read do not change: each
GEMM reads its slice of the weights once.

A whole decode step of Qwen3-8B's shapes (36 layers with their own random weights and caches, so nothing stays
in L2) is captured in a CUDA graph per G and timed; each G's hidden states are compared with G=1's.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.engine.gemm_plan import graph_seconds  # noqa: E402
from nanovllm.kernels import add_rms_norm, paged_decode_attention, qkv_norm_rope_store, silu_and_mul  # noqa: E402

HID, INTER, H, HKV, D, BS = 4096, 12288, 32, 8, 128, 256
EPS = 1e-6


class Stack:
    def __init__(self, layers: int, max_rows: int, max_ctx: int, dev="cuda", dt=torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(0)

        def w(*shape):
            return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02
        self.wqkv = [w((H + 2 * HKV) * D, HID) for _ in range(layers)]   # rows: [q | k | v], heads in order
        self.wo = [w(HID, H * D) for _ in range(layers)]
        self.wgu = [w(2 * INTER, HID) for _ in range(layers)]
        self.wd = [w(HID, INTER) for _ in range(layers)]
        self.norm = torch.ones(HID, device=dev, dtype=dt)
        self.qn = torch.ones(D, device=dev, dtype=dt)
        nblk = max_rows * -(-max_ctx // BS)
        self.kc = [torch.randn(nblk, BS, HKV, D, device=dev, dtype=dt, generator=g) for _ in range(layers)]
        self.vc = [torch.randn(nblk, BS, HKV, D, device=dev, dtype=dt, generator=g) for _ in range(layers)]
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        ang = torch.arange(max_ctx + 1, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        self.cs = torch.cat([ang.cos(), ang.sin()], dim=1)
        self.side = torch.cuda.Stream(dev)
        self.gemm_hi = torch.cuda.Stream(dev, priority=-1)  # GEMMs at high priority, attention at normal
        self.attn_lo = torch.cuda.Stream(dev)
        self.n_layers = layers
        self.grouped = {}  # G -> per layer, per group (qkv weight rows of the group, o_proj column slice)

    def groups(self, G):
        if G not in self.grouped:
            hq, hk = H // G, HKV // G
            out = []
            for wqkv, wo in zip(self.wqkv, self.wo):
                q, k, v = wqkv.split([H * D, HKV * D, HKV * D])
                per = [(torch.cat([q[i * hq * D:(i + 1) * hq * D], k[i * hk * D:(i + 1) * hk * D],
                                   v[i * hk * D:(i + 1) * hk * D]]).contiguous(),
                        wo[:, i * hq * D:(i + 1) * hq * D]) for i in range(G)]
                out.append(per)
            self.grouped[G] = out
        return self.grouped[G]


def make_inputs(B, ctx, seed, dev="cuda"):
    rng = random.Random(seed)
    lens = [max(1, int(ctx * rng.uniform(0.5, 1.5))) for _ in range(B)]
    per = -(-max(lens) // BS)
    bt = torch.arange(B * per, device=dev, dtype=torch.int32).view(B, per)
    seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    pos = seq_lens.long() - 1
    slots = (bt.gather(1, (pos // BS).view(-1, 1)).view(-1).long() * BS + pos % BS)
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    x = torch.randn(B, HID, device=dev, dtype=torch.bfloat16)
    return dict(seq_lens=seq_lens, bt=bt, pos=pos, slots=slots, order=order, x=x)


def step(st: Stack, inp, G: int, mode: str = "alt"):
    """mode "alt": group g's GEMM + attention on stream g % 2; "split": GEMMs (+ RoPE/store) on a high-priority
    stream, attention on another ("splitnp": same streams, equal priority)."""
    x, res = inp["x"], torch.zeros_like(inp["x"])
    B = x.shape[0]
    scale = D ** -0.5
    hq, hk = H // G, HKV // G
    main = torch.cuda.current_stream()
    for li in range(st.n_layers):
        h, res = add_rms_norm(x, res, st.norm, EPS)
        attn = torch.empty(B, H, D, device=x.device, dtype=x.dtype)
        if G == 1:
            qkv = torch.mm(h, st.wqkv[li].t())
            q = qkv_norm_rope_store(qkv, inp["pos"], st.cs, st.qn, st.qn, EPS, st.kc[li], st.vc[li], inp["slots"],
                                    H, HKV, D)
            paged_decode_attention(q, st.kc[li], st.vc[li], inp["seq_lens"], inp["bt"], scale, out=attn,
                                   order=inp["order"])
            o = torch.mm(attn.view(B, H * D), st.wo[li].t())
        elif mode in ("split", "splitnp"):
            per = st.groups(G)[li]
            gs = st.gemm_hi if mode == "split" else st.side
            ats = st.attn_lo
            gs.wait_stream(main)
            ats.wait_stream(main)
            flat = attn.view(B, H * D)
            qs, done = [], []
            with torch.cuda.stream(gs):
                for g, (wq, _) in enumerate(per):
                    qkv = torch.mm(h, wq.t())
                    kc = st.kc[li][:, :, g * hk:(g + 1) * hk]
                    vc = st.vc[li][:, :, g * hk:(g + 1) * hk]
                    qs.append(qkv_norm_rope_store(qkv, inp["pos"], st.cs, st.qn, st.qn, EPS, kc, vc, inp["slots"],
                                                  hq, hk, D))
                    ready = gs.record_event()
                    with torch.cuda.stream(ats):
                        ats.wait_event(ready)
                        paged_decode_attention(qs[g], kc, vc, inp["seq_lens"], inp["bt"], scale,
                                               out=attn[:, g * hq:(g + 1) * hq], order=inp["order"])
                        done.append(ats.record_event())
                o = None
                for g, (_, wo) in enumerate(per):
                    gs.wait_event(done[g])
                    part = flat[:, g * hq * D:(g + 1) * hq * D]
                    o = torch.mm(part, wo.t()) if o is None else o.addmm_(part, wo.t())
            main.wait_stream(gs)
        else:
            per = st.groups(G)[li]
            streams = (main, st.side)
            ready = main.record_event()
            done = []
            for g, (wq, _) in enumerate(per):
                s = streams[g % 2]
                s.wait_event(ready)
                with torch.cuda.stream(s):
                    qkv = torch.mm(h, wq.t())
                    kc = st.kc[li][:, :, g * hk:(g + 1) * hk]
                    vc = st.vc[li][:, :, g * hk:(g + 1) * hk]
                    q = qkv_norm_rope_store(qkv, inp["pos"], st.cs, st.qn, st.qn, EPS, kc, vc, inp["slots"],
                                            hq, hk, D)
                    ready = s.record_event()
                    paged_decode_attention(q, kc, vc, inp["seq_lens"], inp["bt"], scale,
                                           out=attn[:, g * hq:(g + 1) * hq], order=inp["order"])
                    done.append(s.record_event())
            flat = attn.view(B, H * D)
            o = None
            for g, (_, wo) in enumerate(per):
                main.wait_event(done[g])
                part = flat[:, g * hq * D:(g + 1) * hq * D]
                o = torch.mm(part, wo.t()) if o is None else o.addmm_(part, wo.t())
        h, res = add_rms_norm(o, res, st.norm, EPS)
        x = torch.mm(silu_and_mul(torch.mm(h, st.wgu[li].t())), st.wd[li].t())
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--modes", default="alt,split,splitnp")
    ap.add_argument("--cases", default="256:400,256:800,256:1200,160:800,64:800",
                    help="rows:mean context pairs (contexts uniform in [0.5, 1.5] x mean)")
    a = ap.parse_args()
    cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")]
    groups = [int(g) for g in a.groups.split(",")]
    st = Stack(a.layers, max(b for b, _ in cases), max(int(c * 1.5) + 1 for _, c in cases))
    print(f"{a.layers} layers of Qwen3-8B shapes, bf16; ms per decode step (CUDA graph)")
    for B, ctx in cases:
        inp = make_inputs(B, ctx, seed=B + ctx)
        kv_gb = int(inp["seq_lens"].sum()) * HKV * D * 2 * 2 * a.layers / 1e9
        st.n_layers = 1
        ref1 = step(st, inp, 1).float()
        st.n_layers = a.layers
        line = f"rows {B:4d} ctx ~{ctx:5d} (KV {kv_gb:5.1f} GB):"
        base = None
        for G in groups:
            for mode in (["-"] if G == 1 else a.modes.split(",")):
                t = graph_seconds(lambda inp=inp, G=G, mode=mode: step(st, inp, G, mode)) * 1e3
                st.n_layers = 1
                err = (step(st, inp, G, mode).float() - ref1).abs().max().item() / ref1.abs().max().item()
                st.n_layers = a.layers
                base = base or t
                line += f"\n    G={G} {mode:7s} {t:7.3f} ms ({t / base - 1:+.1%}; one layer's rel err {err:.1e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
