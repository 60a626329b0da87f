"""The router's own costs, with the workers out of the way: the gRPC and Ray floors under its hot path
(scripted servers), the tokens/s and requests/s it sustains and the CPU it spends a token and a request
(against simulated workers, also as two replicas), and how closely `pdserve bench`'s runner keeps to its
schedule (a scripted server); and whether bad requests beside streams under load leave them token-exact and
on time (bad_neighbours, #47)."""
