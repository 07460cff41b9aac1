#!/usr/bin/env bash
# Make a CA and certificates with openssl, for Warren's TLS listeners and node links
# (docs/security.md). File names follow RabbitMQ's tls-gen:
#
#   .ci/make-certs.sh DIR [--client-cn NAME] [--days N] [--nodes HOST[,HOST...]]
#
#   DIR/ca_certificate.pem, ca_key.pem          the CA (keep ca_key.pem private)
#   DIR/server_certificate.pem, server_key.pem  CN=localhost, SAN DNS:localhost, IP:127.0.0.1
#   DIR/client_certificate.pem, client_key.pem  CN=NAME (default guest), SAN DNS:NAME
#   DIR/node-HOST_certificate.pem, _key.pem     per --nodes HOST: CN=HOST, SAN HOST (an IP
#                                               or DNS name: the host of the node's
#                                               cluster.listen), serverAuth and clientAuth,
#                                               for [cluster.tls] (and [admin.tls])
#
# Keys are EC P-256, unencrypted (Warren reads unencrypted PEM keys only). Existing files
# in DIR are replaced. Keep ca_key.pem off the nodes: whoever holds it can join the cluster.
set -euo pipefail

usage() { sed -n '2,18p' "$0" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
DIR="$1"
shift
CLIENT_CN=guest
DAYS=365
NODES=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --client-cn) CLIENT_CN="$2"; shift 2 ;;
        --days) DAYS="$2"; shift 2 ;;
        --nodes) NODES="$2"; shift 2 ;;
        *) usage ;;
    esac
done
command -v openssl >/dev/null || { echo "make-certs: openssl not found" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# The CA.
key ca_key.pem
openssl req -x509 -new -key ca_key.pem -sha256 -days "$DAYS" -subj "/O=Warren test CA/CN=Warren test CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca_certificate.pem

# issue NAME CN SAN EKU: NAME_key.pem and NAME_certificate.pem signed by the CA.
issue() {
    local name="$1" cn="$2" san="$3" eku="$4" ext
    key "${name}_key.pem"
    openssl req -new -key "${name}_key.pem" -subj "/O=Warren tests/CN=$cn" -out "$name.csr"
    ext="$(mktemp)"
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature" \
        "extendedKeyUsage=$eku" "subjectAltName=$san" >"$ext"
    openssl x509 -req -in "$name.csr" -CA ca_certificate.pem -CAkey ca_key.pem \
        -CAcreateserial -days "$DAYS" -sha256 -extfile "$ext" \
        -out "${name}_certificate.pem" 2>/dev/null
    rm -f "$name.csr" "$ext"
}
issue server localhost "DNS:localhost,IP:127.0.0.1" serverAuth
issue client "$CLIENT_CN" "DNS:$CLIENT_CN" clientAuth
node_files=()
IFS=',' read -r -a node_hosts <<<"$NODES"
for host in "${node_hosts[@]}"; do
    [[ -n "$host" ]] || continue
    # A dialling node checks the name of the host it dialled: an IP SAN for an address,
    # a DNS SAN for a name.
    if [[ "$host" =~ ^[0-9.]+$ || "$host" == *:* ]]; then san="IP:$host"; else san="DNS:$host"; fi
    issue "node-$host" "$host" "$san" "serverAuth,clientAuth"
    node_files+=("node-${host}_certificate.pem")
done
rm -f ca_certificate.srl
# Certificates are public; keys stay readable by their owner only.
chmod 644 ./*_certificate.pem
openssl verify -CAfile ca_certificate.pem server_certificate.pem client_certificate.pem \
    "${node_files[@]}" >/dev/null
echo "make-certs: CA, server (localhost, 127.0.0.1), client (CN=$CLIENT_CN)${NODES:+ and nodes ($NODES)} in $DIR"
