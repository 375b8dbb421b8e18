#!/bin/bash
# Writes a throwaway PKI for TLS tests into DIR (made by the caller):
#   ca.{crt,key}            the CA every good certificate chains to
#   server.{crt,key}        a daemon's: subjectAltName IP:127.0.0.1, DNS:localhost and
#                           the daemon role (URI:urn:zeroshard:role:daemon)
#   client.{crt,key}        a trainer's: the trainer role
#   admin.{crt,key}         an operator's: the admin role
#   norole.{crt,key}        signed by the CA, naming no role
#   expired.{crt,key}       signed by the CA, valid 2020-01-01..2020-01-02 only
#   other_ca.{crt,key}      an unrelated CA
#   stranger.{crt,key}      signed by other_ca
# Usage: make_test_certs.sh DIR
set -euo pipefail
dir="$1"
cd "${dir}"
subj() { echo "/CN=$1/O=zeroshard-test"; }
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }
ca() {
  key "$1"
  openssl req -x509 -new -key "$1.key" -subj "$(subj "$1")" -days 30 -out "$1.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}
# leaf NAME CA SAN
leaf() {
  key "$1"
  openssl req -new -key "$1.key" -subj "$(subj "$1")" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -days 30 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
ca ca
ca other_ca
leaf server ca "IP:127.0.0.1,DNS:localhost,URI:urn:zeroshard:role:daemon"
leaf client ca "DNS:trainer,URI:urn:zeroshard:role:trainer"
leaf admin ca "DNS:admin,URI:urn:zeroshard:role:admin"
leaf norole ca "DNS:norole"
leaf stranger other_ca "DNS:stranger"
# An expired certificate: `openssl ca` takes explicit validity dates.
key expired
openssl req -new -key expired.key -subj "$(subj expired)" -out expired.csr 2>/dev/null
printf 'subjectAltName=DNS:expired\nextendedKeyUsage=serverAuth,clientAuth\n' >expired.ext
mkdir -p ca.db
: >ca.db/index.txt
echo 1000 >ca.db/serial
cat >ca.cnf <<CNF
[ ca ]
default_ca = test_ca
[ test_ca ]
dir = ca.db
database = ca.db/index.txt
new_certs_dir = ca.db
serial = ca.db/serial
default_md = sha256
policy = any
[ any ]
commonName = supplied
CNF
openssl ca -batch -config ca.cnf -cert ca.crt -keyfile ca.key -in expired.csr -out expired.crt \
  -startdate 20200101000000Z -enddate 20200102000000Z -extfile expired.ext -notext 2>/dev/null
