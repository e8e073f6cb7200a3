/* server/door.c's socket filter, tested on datagram sockets (the same classic BPF program and the
 * same network-header loads as on a listening TCP socket): packets from the kept-out address are
 * dropped, packets from any other address arrive, and removing the filter lets everyone in. IPv4
 * over 127.0.0.1/127.0.0.2, IPv6 over ::1 (the only loopback address it has). */
#include "door.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void key_of(int fam, const char *addr, uint8_t key[17])
{
    memset(key, 0, 17);
    key[0] = fam == AF_INET ? 4 : 6;
    cr_assert_eq(inet_pton(fam, addr, key + 1), 1, "%s", addr);
}

/* A datagram socket bound to addr (port chosen by the system); its port in *port. */
static int bound(int fam, const char *addr, uint16_t *port)
{
    const int fd = socket(fam, SOCK_DGRAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_storage ss = {0};
    socklen_t len;
    if (fam == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        inet_pton(AF_INET, addr, &a->sin_addr);
        len = sizeof *a;
    } else {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        inet_pton(AF_INET6, addr, &a->sin6_addr);
        len = sizeof *a;
    }
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) {
        close(fd);
        return -1;
    }
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&ss, &len), 0);
    *port = ntohs(fam == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port : ((struct sockaddr_in6 *)&ss)->sin6_port);
    return fd;
}

/* Whether a datagram from `from` reaches the socket rx listening at to:port. */
static bool arrives(int fam, const char *from, const char *to, uint16_t port, int rx)
{
    uint16_t unused;
    const int tx = bound(fam, from, &unused);
    cr_assert_geq(tx, 0, "bind %s: %s", from, strerror(errno));
    struct sockaddr_storage ss = {0};
    socklen_t len;
    if (fam == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons(port);
        inet_pton(AF_INET, to, &a->sin_addr);
        len = sizeof *a;
    } else {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(port);
        inet_pton(AF_INET6, to, &a->sin6_addr);
        len = sizeof *a;
    }
    cr_assert_eq(sendto(tx, "x", 1, 0, (struct sockaddr *)&ss, len), 1);
    close(tx);
    struct pollfd p = {.fd = rx, .events = POLLIN};
    if (poll(&p, 1, 300) <= 0) {
        return false;
    }
    char b[8];
    return recv(rx, b, sizeof b, 0) == 1;
}

Test(door, ipv4_keeps_one_address_out)
{
    uint16_t port;
    const int rx = bound(AF_INET, "127.0.0.1", &port);
    cr_assert_geq(rx, 0);
    uint8_t key[17];
    key_of(AF_INET, "127.0.0.2", key);
    cr_assert_eq(kr_door_keep_out(rx, key), 0, "attach: %s", strerror(errno));
    cr_expect(!arrives(AF_INET, "127.0.0.2", "127.0.0.1", port, rx), "127.0.0.2 is kept out");
    cr_expect(arrives(AF_INET, "127.0.0.1", "127.0.0.1", port, rx), "127.0.0.1 gets in");
    cr_expect(arrives(AF_INET, "127.0.0.3", "127.0.0.1", port, rx), "127.0.0.3 gets in");
    cr_assert_eq(kr_door_open(rx), 0);
    cr_expect(arrives(AF_INET, "127.0.0.2", "127.0.0.1", port, rx), "127.0.0.2 gets in once the door is open");
    close(rx);
}

Test(door, ipv6_keeps_one_address_out)
{
    uint16_t port;
    const int rx = bound(AF_INET6, "::1", &port);
    if (rx < 0) {
        cr_skip_test("no IPv6 loopback here (bind ::1: %s): the IPv6 filter is not exercised", strerror(errno));
    }
    uint8_t key[17];
    key_of(AF_INET6, "::2", key);
    cr_assert_eq(kr_door_keep_out(rx, key), 0, "attach: %s", strerror(errno));
    cr_expect(arrives(AF_INET6, "::1", "::1", port, rx), "::1 gets in while ::2 is kept out");
    key_of(AF_INET6, "::1", key);
    cr_assert_eq(kr_door_keep_out(rx, key), 0, "attach: %s", strerror(errno));
    cr_expect(!arrives(AF_INET6, "::1", "::1", port, rx), "::1 is kept out");
    cr_assert_eq(kr_door_open(rx), 0);
    cr_expect(arrives(AF_INET6, "::1", "::1", port, rx), "::1 gets in once the door is open");
    close(rx);
}
