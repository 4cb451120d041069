package quiesce

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"time"
)

// The peer port runs TLS 1.3 from Go's standard library, both ways
// authenticated (docs/security.md, "The peer port"). Each cluster key
// derives an Ed25519 certificate authority: every holder of the key computes
// the same one, so there is nothing to distribute beyond the key file. At
// start, mpid makes a fresh key pair and certifies it, with its node name,
// under the CA of its current key; it trusts the CAs of every key of its
// file (key rotation). A dialling node checks that the certificate names
// the node it means to reach and states that node in its hello; the
// answering node checks the client's certificate against the same CAs.

// peerALPN names the protocol in the TLS handshake, so that no other TLS
// service of the cluster's key (there is none today) could be confused with
// it.
const peerALPN = "mpipause-quiesce"

// caLabel separates the CA's seed from anything else derived from the key.
const caLabel = "mpipause peer CA v1"

// ErrAuth: a peer failed authentication (no key, another key).
var ErrAuth = errors.New("authentication failed")

// ErrWrongNode: the node that answered is not the node dialled (a name
// resolving to another member's address: DNS, /etc/hosts or ARP).
var ErrWrongNode = errors.New("another node answered")

// Identity is what a node proves on the peer port and whom it trusts.
type Identity struct {
	name  string
	cert  tls.Certificate
	roots *x509.CertPool
}

// The validity of every certificate spans all time: a leaf's private key
// lives only in its mpid's memory for the life of the process, and trust
// ends with the cluster key (rotation), not with a date, so that a node
// whose clock is wrong is not refused for it.
var (
	certFrom  = time.Unix(0, 0).UTC()
	certUntil = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)
)

// NewIdentity makes node name's identity under keys: a certificate of a
// fresh key pair for name from keys.Current's CA, trusting every key's CA.
func NewIdentity(name string, keys *Keyring) (*Identity, error) {
	if name == "" {
		return nil, errors.New("peer identity: empty node name")
	}
	id := &Identity{name: name, roots: x509.NewCertPool()}
	var signer ed25519.PrivateKey
	var parent *x509.Certificate
	for i, k := range keys.All() {
		ca, priv, err := clusterCA(k)
		if err != nil {
			return nil, err
		}
		id.roots.AddCert(ca)
		if i == 0 {
			signer, parent = priv, ca
		}
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("peer identity: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("peer identity: %w", err)
	}
	leaf := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    certFrom,
		NotAfter:     certUntil,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, parent, pub, signer)
	if err != nil {
		return nil, fmt.Errorf("peer identity: certify %s: %w", name, err)
	}
	id.cert = tls.Certificate{Certificate: [][]byte{der}, PrivateKey: priv}
	return id, nil
}

// Name is the node name the identity certifies.
func (id *Identity) Name() string { return id.name }

// clusterCA is the CA that key k derives: the same certificate and key on
// every node (Ed25519 signatures are deterministic).
func clusterCA(k *Key) (*x509.Certificate, ed25519.PrivateKey, error) {
	priv := ed25519.NewKeyFromSeed(k.Derive(caLabel))
	pub := priv.Public().(ed25519.PublicKey)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "mpipause cluster"},
		NotBefore:             certFrom,
		NotAfter:              certUntil,
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, priv)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster CA: %w", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster CA: %w", err)
	}
	return ca, priv, nil
}

// errNotCluster: the peer's certificate does not chain to a key of ours.
var errNotCluster = errors.New("certificate not from this cluster's key")

// peerName checks the peer's certificate against the cluster's CAs and
// returns the node it names.
func (id *Identity) peerName(cs tls.ConnectionState) (string, error) {
	if len(cs.PeerCertificates) == 0 {
		return "", errNotCluster
	}
	leaf := cs.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: id.roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return "", errNotCluster
	}
	return leaf.Subject.CommonName, nil
}

// clientConfig is the TLS configuration for dialling node to at addr.
func (id *Identity) clientConfig(to, addr string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{id.cert},
		NextProtos:   []string{peerALPN},
		// The chain and the node's name are checked in VerifyConnection
		// against the cluster's own CAs: nothing here is a web host name.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			got, err := id.peerName(cs)
			if err != nil {
				return permanentError{fmt.Errorf("%w: %s (%s) is %v (every node needs the same cluster key file)", ErrAuth, to, addr, err)}
			}
			if got != to {
				return permanentError{fmt.Errorf("%w: %s's address (%s) answered as %s", ErrWrongNode, to, addr, got)}
			}
			return nil
		},
	}
}

// serverConfig is the TLS configuration of the peer port: any node of the
// cluster may call.
func (id *Identity) serverConfig() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{id.cert},
		NextProtos:   []string{peerALPN},
		ClientAuth:   tls.RequireAnyClientCert,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := id.peerName(cs)
			return err
		},
	}
}

// refusedByPeer turns the alert of a server that refused this node's
// certificate, which TLS 1.3 delivers only at the first read after the
// handshake, into an error that says what to do.
func refusedByPeer(to string, err error) error {
	if s := err.Error(); strings.Contains(s, "remote error: tls: bad certificate") || strings.Contains(s, "remote error: tls: certificate required") {
		return permanentError{fmt.Errorf("%w: %s refused this node's certificate (every node needs the same cluster key file)", ErrAuth, to)}
	}
	return err
}

// handshakeCause names why a client's handshake failed, for
// ServerOptions.Refused.
func handshakeCause(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errNotCluster):
		return "its certificate is not from this cluster's key"
	case strings.Contains(err.Error(), "remote error: tls: bad certificate"):
		return "it holds another cluster key (it refused this node's certificate)"
	case errors.As(err, &ne) && ne.Timeout():
		return "no handshake in time"
	case errors.As(err, new(tls.RecordHeaderError)):
		return "it does not speak TLS (an mpid of another version, or not mpid)"
	}
	return "TLS handshake failed"
}
