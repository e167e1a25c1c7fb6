"""The sampled half of a verify + draft step at beam-mini's shapes (b sequences, K = 15, vocab 8192), each
captured in a CUDA graph and replayed: torch (contract_probs and the acceptance in torch, as before) against
the Triton kernels (sample_probs, accept_block), and their parts."""
import json, sys, torch
from server.engine import block_sampling as bs
from workbench.variants.kernels.sample_probs import sample_probs
from workbench.variants.kernels.rejection_sampling import accept_block
from workbench.variants.sample import contract_probs

def timed(fn, reps=300):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(20): g.replay()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(reps): g.replay()
        b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(ts)[2]

V, K, dev = 8192, 15, "cuda"
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
for b in (1, 4):
    gen = torch.Generator(dev).manual_seed(0)
    tl_ = torch.randn(b * (K + 1), V, device=dev) * 3          # target logits
    dl = torch.randn(b * K, V, device=dev) * 3                  # draft logits
    st = lambda n: (torch.ones(n, device=dev), torch.zeros(n, dtype=torch.int64, device=dev), torch.full((n,), 0.95, device=dev))
    q = contract_probs(dl, *st(b * K)).view(b, K, V)
    drafts = torch.multinomial(q.view(b * K, V).float(), 1).view(b, K)
    limit = torch.full((b,), K, device=dev); greedy = torch.zeros(b, dtype=torch.bool, device=dev)
    kg = torch.zeros(b, dtype=torch.int64, device=dev)
    def noise(n): return torch.empty(n, V, dtype=torch.float64, device=dev).exponential_()
    def u(): return torch.rand(b, K, dtype=torch.float64, device=dev)
    def tail_torch():
        p = contract_probs(tl_, *st(b * (K + 1))).view(b, K + 1, V)
        bs.accept_drafts_torch(p, q, drafts, u(), limit, noise(b), greedy, kg, kg)
        bs.draft_draws_torch(dl, *st(b * K), noise(b * K))
    def tail_kernels():
        p = sample_probs(tl_, *st(b * (K + 1))).view(b, K + 1, V)
        accept_block(p, q, drafts, u(), limit, noise(b), greedy, kg, kg)
        sample_probs(dl, *st(b * K), noise=noise(b * K))
    p_ref = contract_probs(tl_, *st(b * (K + 1)))
    r = {"probs_max_abs_diff": float((p_ref - sample_probs(tl_, *st(b * (K + 1)))).abs().max()),
         "tail_torch_us": timed(tail_torch), "tail_kernels_us": timed(tail_kernels),
         "contract_probs_target_us": timed(lambda: contract_probs(tl_, *st(b * (K + 1)))),
         "sample_probs_target_us": timed(lambda: sample_probs(tl_, *st(b * (K + 1)))),
         "sample_probs_target_fp32_us": timed(lambda: sample_probs(tl_, *st(b * (K + 1)), dtype=torch.float32)),
         "sample_probs_target_block4096_us": timed(lambda: sample_probs(tl_, *st(b * (K + 1)), block=4096)),
         "sort_fp64_us": timed(lambda: tl_.double().sort(-1, descending=True)),
         "noise_draft_us": timed(lambda: noise(b * K)),
         "top_k_50_sample_probs_us": timed(lambda: sample_probs(tl_, st(b * (K + 1))[0], torch.full((b * (K + 1),), 50, device=dev), st(b * (K + 1))[2]))}
    out[f"b{b}"] = r
    print(b, r, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
