# gradflow dashboard image.
# Build: docker build -t gradflow .   Run: docker run -p 8501:8501 gradflow
FROM python:3.11.7-slim-bookworm

# Chromium is for static image export (kaleido) only; fonts make exported text readable.
RUN apt-get update \
    && apt-get install -y --no-install-recommends chromium fonts-liberation curl \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TF_CPP_MIN_LOG_LEVEL=3 \
    GRADFLOW_CHROMIUM=/usr/bin/chromium \
    BROWSER_PATH=/usr/bin/chromium \
    GRADFLOW_DB=/home/gradflow/data/runs.db

RUN useradd --create-home --uid 10001 gradflow
WORKDIR /app

COPY requirements.txt .
RUN pip install -r requirements.txt

COPY --chown=gradflow:gradflow . .
RUN pip install --no-deps . && mkdir -p /home/gradflow/data && chown -R gradflow:gradflow /home/gradflow/data
# Plotly.js and the live-chart module as static files (static/gradflow/), in the
# image: the app folder belongs to root, and the server only checks them at start.
RUN python -c "import pathlib; from gradflow.ui.live_chart import publish_assets; assert publish_assets(pathlib.Path('/app'))"

USER gradflow
EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD curl --fail --silent http://localhost:8501/_stcore/health || exit 1

CMD ["python", "-m", "streamlit", "run", "app.py", "--server.port=8501", "--server.address=0.0.0.0", "--server.headless=true"]
