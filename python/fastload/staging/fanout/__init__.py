"""Fan-out staging (``stage(..., fanout=True)``): the nodes of a job stage one dataset
while the shared store serves it about once in total.

Every process of the job calls ``stage(src, dst, fanout=True)``. The first process of
each node (its leader) takes the node lock; the others wait on it as for any stage and
then find the copy complete. The leaders form a group (exchange.py, over gloo or MPI) and:

- a tree or a file: node 0 lists the source and sends the listing; each leader works
  out what its destination lacks (the tree pipeline's own plan: journal, manifest);
  what any node lacks is cut into units (a small file, or a chunk of a big one, on the
  manifest's chunk boundaries) and dealt out: a unit some node already holds is read
  from that node's disk, the rest in contiguous runs balanced by bytes, one per node,
  from the store. In rounds, each leader sends its next units (about ``ROUND`` bytes,
  with their chunk digests) and receives everyone's; it writes what it lacks under a
  temporary name, checks the digests on arrival, renames each file into place once
  whole, and journals it. The tree pipeline then runs as usual: it finds every file in
  the journal, copies nothing and writes the manifest.
- an archive: its bytes are cut into pieces dealt round-robin (piece ``k`` to node
  ``k mod N``), so each round delivers the next ``N`` pieces in order to everyone, and
  each node feeds the whole stream to its own extractor (the archive pipeline, with a
  reader that takes its blocks from the exchange). A node whose copy is complete still
  reads its pieces for the others and extracts nothing.
- a zip (zips.py): node 0 reads the central directory and sends the listing; the members
  no node holds are dealt in contiguous runs of the archive by compressed bytes, each
  node extracts its run from the store, and the files are exchanged as a tree's (each
  read from the disk of the node that extracted it).

Failure anywhere stops every leader within the round timeout, naming the node; what each
finished stays journalled, so a rerun fetches only what is missing.
"""

from .exchange import FanoutError
from .run import stage_fanout

__all__ = ["FanoutError", "stage_fanout"]
