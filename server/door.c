#include "door.h"

#include <linux/filter.h>
#include <string.h>
#include <sys/socket.h>

/* A packet's network header is reached at SKF_NET_OFF from a TCP socket's filter (whose data
 * starts at the TCP header). IPv4: the version nibble 4, the source at offset 12. IPv6: version 6,
 * the source at offset 8. Words load in network order, compared as such. */
#define LD_NET_B(off) (struct sock_filter)BPF_STMT(BPF_LD | BPF_B | BPF_ABS, (uint32_t)(SKF_NET_OFF + (off)))
#define LD_NET_W(off) (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (uint32_t)(SKF_NET_OFF + (off)))

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

int kr_door_keep_out(int fd, const uint8_t key[17])
{
    struct sock_filter prog[16];
    int n = 0;
    prog[n++] = LD_NET_B(0);
    prog[n++] = (struct sock_filter)BPF_STMT(BPF_ALU | BPF_RSH | BPF_K, 4);
    if (key[0] == 4) {
        /* version 4? else accept; source == key? drop : accept */
        prog[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 4, 0, 3);
        prog[n++] = LD_NET_W(12);
        prog[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, be32(key + 1), 0, 1);
        prog[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, 0);
    } else {
        prog[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 6, 0, 9);
        for (int w = 0; w < 4; w++) {
            prog[n++] = LD_NET_W(8 + 4 * w);
            prog[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, be32(key + 1 + 4 * w), 0, (uint8_t)(7 - 2 * w));
        }
        prog[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, 0);
    }
    prog[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, 0xffffffffu);
    struct sock_fprog fp = {.len = (unsigned short)n, .filter = prog};
    return setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &fp, sizeof fp);
}

int kr_door_open(int fd)
{
    int unused = 0;
    return setsockopt(fd, SOL_SOCKET, SO_DETACH_FILTER, &unused, sizeof unused);
}
