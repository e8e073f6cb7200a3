#pragma once
/* Keeping one client address out of a listening TCP socket, in the kernel: a classic BPF socket
 * filter on the listener drops that address's packets (its SYNs), so that its new connections
 * never reach the accept queue and cost the server nothing; the client retries as after a lost
 * packet. Used by the connection policy of conns.h while one address crowds the others out. */
#include <stdint.h>

/* Drops the packets of the address `key` (conns.h's form: family 4 or 6, then its bytes) at the
 * listener `fd`. 0, or -1 with errno (the filter could not be attached). */
int kr_door_keep_out(int fd, const uint8_t key[17]);
/* Removes the filter: everyone may connect again. 0, or -1 with errno. */
int kr_door_open(int fd);
