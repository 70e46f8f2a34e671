// An OIDC issuer for the identity tests: oauth2-mock-server (discovery at
// /.well-known/openid-configuration, the JWKS at /jwks) on 127.0.0.1, plus
// a control port the test drives it with:
//
//   POST   /keys            {"alg": "RS256" | "ES256"}  -> {"kid"}   a key made now, published
//   DELETE /keys/<kid>                                  -> {}        no longer published
//   POST   /token           {"kid", "claims": {...}}    -> {"token"} signed with that key
//
// Usage: node issuer.mjs [PORT]. It prints one line of JSON once both
// listen, {"issuer": URL, "control": URL}, and runs until killed.
// Keys are made at run time; none is stored.
import http from 'node:http';
import { OAuth2Server } from 'oauth2-mock-server';

const port = Number(process.argv[2] ?? 0);
// The private JWKs published, oldest first.
let published = [];
let server;
let issuerPort = port;

// (Re)starts the issuer with exactly `published`: the store cannot forget
// a key, so a removal starts a new one on the same port.
async function serve() {
  if (server) await server.stop();
  server = new OAuth2Server();
  for (const jwk of published) await server.issuer.keys.add(jwk);
  await server.start(issuerPort, '127.0.0.1');
  issuerPort = server.address().port;
}

async function makeKey(alg) {
  const scratch = new OAuth2Server();
  return scratch.issuer.keys.generate(alg);
}

function reply(res, status, body) {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
  res.end(text);
}

async function handle(req, body) {
  if (req.method === 'POST' && req.url === '/keys') {
    const jwk = await makeKey(body.alg ?? 'RS256');
    published.push(jwk);
    await server.issuer.keys.add(jwk);
    return [200, { kid: jwk.kid }];
  }
  if (req.method === 'DELETE' && req.url.startsWith('/keys/')) {
    const kid = decodeURIComponent(req.url.slice('/keys/'.length));
    published = published.filter((k) => k.kid !== kid);
    await serve();
    return [200, {}];
  }
  if (req.method === 'POST' && req.url === '/token') {
    if (!published.some((k) => k.kid === body.kid)) return [404, { error: `no key ${body.kid}` }];
    const token = await server.issuer.buildToken({
      kid: body.kid,
      scopesOrTransform: (_header, payload) => Object.assign(payload, body.claims ?? {}),
    });
    return [200, { token }];
  }
  return [404, { error: 'no such route' }];
}

const control = http.createServer((req, res) => {
  let raw = '';
  req.on('data', (chunk) => { raw += chunk; });
  req.on('end', () => {
    let body = {};
    try {
      body = raw ? JSON.parse(raw) : {};
    } catch {
      reply(res, 400, { error: 'not JSON' });
      return;
    }
    handle(req, body)
      .then(([status, answer]) => reply(res, status, answer))
      .catch((e) => reply(res, 500, { error: String(e) }));
  });
});

published.push(await makeKey('RS256'));
await serve();
control.listen(0, '127.0.0.1', () => {
  const c = control.address();
  console.log(JSON.stringify({
    issuer: server.issuer.url,
    control: `http://127.0.0.1:${c.port}`,
    kid: published[0].kid,
  }));
});
