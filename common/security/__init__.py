"""Security building blocks shared by the services. Import the modules themselves (nothing is re-exported here,
so that importing one never pulls in the others' dependencies):

- :mod:`common.security.kv_crypto`: encryption of KV blocks at rest (AES-256-GCM);
- :mod:`common.security.auth`: API keys and the :class:`~common.security.auth.Authenticator` of the public
  fronts (gRPC and HTTP), credentials from headers/metadata, :func:`~common.security.auth.principal_of`;
- :mod:`common.security.jwt_auth`: JWT validation (PyJWT) behind the authenticator;
- :mod:`common.security.errors`: :class:`~common.security.errors.AuthError`, the reason a credential was refused;
- :mod:`common.security.grpc_auth`: the gRPC server interceptor that enforces the authenticator.
"""
