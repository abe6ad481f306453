// SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104) for authenticating the
// rendezvous and transport handshakes with a shared job secret. Self-contained
// so the core needs no crypto library; speed is irrelevant at handshake sizes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace rr {

std::array<uint8_t, 32> sha256(const void* data, size_t n);
std::array<uint8_t, 32> hmac_sha256(const std::string& key, const void* msg, size_t n);

// Compares without an early exit, so the time taken does not leak how many
// leading bytes of a guessed MAC were right.
bool constant_time_equal(const uint8_t* a, const uint8_t* b, size_t n);

// n bytes from the kernel CSPRNG (getrandom(2), falling back to /dev/urandom).
// Throws kInternal if neither is available.
std::string random_bytes(size_t n);

}  // namespace rr
