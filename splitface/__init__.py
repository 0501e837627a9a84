"""splitface: split and federated face-recognition training between phones and an edge server.

Importing it makes OpenMP's idle threads sleep instead of spin (OMP_WAIT_POLICY=PASSIVE, unless the environment
says otherwise), before torch loads libgomp, which reads the policy once. libgomp's default keeps each thread of
a parallel team spinning at every barrier for about 300,000 turns; with the edge server's team of one thread a
core beside the devices' processes, or beside any other job, a spinning thread holds the core its partner needs.
On this project's 2-core machines, with another training job running, the server's step on a batch of 32
(IResNet-small, 64 px) took 3.7 s in the default policy against 0.5 s passive, and a 2-device run 59 s against
22 s; with nothing else running, 0.33 s against 0.26 s (docs/testing.md). Child processes inherit the setting."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
