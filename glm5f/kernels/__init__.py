"""kernels: the ops that have a fast path -- the DSA sparse attention dispatch (dsa), its Triton kernels
(triton_dsa) and union plan (sparse_union), and the KDA chunked op with its naive recurrent reference (kda).

Imports only core/. Each op's torch reference stands beside its kernel."""
