import os

# Keep each test process to one thread: multi-rank tests share 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
