# perf script (comm, tid, ip, sym, dso) -> folded stacks "comm;root;...;leaf count"
import sys, collections
counts = collections.Counter()
head = None; frames = []
def flush():
    if head is not None:
        counts[";".join([head] + list(reversed(frames)))] += 1
for line in sys.stdin:
    line = line.rstrip("\n")
    if not line.strip():
        flush(); head = None; frames = []; continue
    if not line.startswith((" ", "\t")):
        flush(); frames = []
        head = line.split()[0]
        continue
    parts = line.strip().split(None, 1)
    sym = parts[1] if len(parts) > 1 else "?"
    sym = sym.rsplit(" (", 1)[0]
    frames.append(sym.replace(";", ":"))
flush()
for k, v in counts.most_common():
    print(f"{k} {v}")
